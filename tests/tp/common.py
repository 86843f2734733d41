"""Shared by the TP tests: a workload with shared prefixes, HF references, a config that
forces preemption."""
import random

from tests.model.hf_reference import hf_greedy

GREEDY = dict(temperature=0, ignore_eos=True)
# a 9-block pool of 8-token blocks cannot hold the batch: the scheduler must preempt
PREEMPTING = dict(block_size=8, num_kv_blocks=9, max_num_batched_tokens=32, enable_prefix_caching=True)


def workload(seed=2, n=8):
    rng = random.Random(seed)
    shared = [rng.randrange(1, 370) for _ in range(40)]
    prompts, max_tokens = [], []
    for i in range(n):
        own = [rng.randrange(1, 370) for _ in range(rng.randrange(1, 25))]
        prompts.append(shared[: rng.randrange(8, 41)] + own if i % 2 else own)
        max_tokens.append(rng.randrange(4, 14))
    return prompts, max_tokens


_refs = {}


def hf_reference(path, prompts, max_tokens):
    key = (path, tuple(map(tuple, prompts)), tuple(max_tokens))
    if key not in _refs:
        _refs[key] = [hf_greedy(path, p, m) for p, m in zip(prompts, max_tokens)]
    return _refs[key]


def generate(llm, prompts, max_tokens):
    from pagedllm import SamplingParams
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]
