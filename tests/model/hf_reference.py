"""Independent reference: HF transformers, float32, full recompute each step (no KV cache)."""

from __future__ import annotations

import functools
import random

import torch


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    # eager attention: the reference computes what the config says (SDPA, which some transformers
    # versions pick by default, drops Gemma 2's attention soft cap); .float() rather than dtype=,
    # which older transformers do not take
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()


@torch.inference_mode()
def hf_logits(path: str, token_ids: list[int]) -> torch.Tensor:
    return hf_model(path)(torch.tensor([token_ids])).logits[0, -1].float()


@torch.inference_mode()
def hf_position_logits(path: str, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab]: row i is HF's logits after token_ids[: i + 1] (causal: one forward serves
    every prefix of the sequence)."""
    return hf_model(path)(torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(path: str, prompt: list[int], max_tokens: int) -> list[int]:
    model = hf_model(path)
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


GREEDY = dict(temperature=0, ignore_eos=True)


def workload(seed=0, n=8):
    """Prompts of random token ids (half share a prefix of 8-40 tokens) and their max_tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 370) for _ in range(40)]
    prompts = []
    for i in range(n):
        own = [rng.randrange(1, 370) for _ in range(rng.randrange(1, 25))]
        prompts.append(shared[: rng.randrange(8, 41)] + own if i % 2 else own)
    max_tokens = [rng.randrange(4, 14) for _ in range(n)]
    return prompts, max_tokens


_ref_cache = {}


def reference(path, prompts, max_tokens):
    """HF greedy continuations, cached per (model, workload)."""
    key = (path, tuple(map(tuple, prompts)), tuple(max_tokens))
    if key not in _ref_cache:
        _ref_cache[key] = [hf_greedy(path, p, m) for p, m in zip(prompts, max_tokens, strict=False)]
    return _ref_cache[key]


def generate(llm, prompts, max_tokens, order=None):
    """Greedy token ids from an LLM, submitted in `order` (default: as given), returned in input order."""
    from pagedllm import SamplingParams

    idx = list(range(len(prompts))) if order is None else order
    outs = llm.generate(
        [prompts[i] for i in idx], [SamplingParams(max_tokens=max_tokens[i], **GREEDY) for i in idx], use_tqdm=False
    )
    res = [None] * len(prompts)
    for i, o in zip(idx, outs, strict=False):
        res[i] = o.outputs[0].token_ids
    return res


def step_logits(llm, prompts, params):
    """Run `prompts` through `llm`; returns, for every logits row of every step (mixed chunked
    prefills and decodes), (the row, its sequence's token ids once finished, n): the row was
    computed from the first n of those ids and sampled id n. Also each step's sequence ids."""
    captured = []
    real_sample = llm.runner.sample

    def spy(logits, inp):
        captured.append((logits.clone(), list(inp.sample_seq_ids)))
        return real_sample(logits, inp)

    seqs = {}
    real_add = llm.engine.scheduler.add

    def add(seq):
        seqs[seq.seq_id] = seq
        real_add(seq)

    llm.runner.sample, llm.engine.scheduler.add = spy, add
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.runner.sample, llm.engine.scheduler.add = real_sample, real_add
    lengths = {sid: len(s.prompt_token_ids) for sid, s in seqs.items()}
    rows = []
    for logits, ids in captured:
        for row, sid in enumerate(ids):
            rows.append((logits[row], tuple(seqs[sid].token_ids), lengths[sid]))
            lengths[sid] += 1
    return rows, [ids for _, ids in captured]
