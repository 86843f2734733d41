"""Parallel sampling, best_of and logprobs through LLM.generate on a tiny real model (CPU): the
children of an n-request are the seeded n=1 requests (seeds s, s+1, ...), best_of keeps the
samples with the highest cumulative logprob (checked against HF's teacher-forced float32
log-softmax), and the outputs have vLLM's shapes."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.sampling_params import BeamSearchParams
from tests.model.hf_reference import hf_model

PROMPT = "def fibonacci(n):"
SAMPLED = dict(temperature=1.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    with LLM(tiny_models["qwen3"], device="cpu", num_kv_blocks=128, block_size=8, max_num_seqs=8) as llm:
        yield llm


def gen(llm, prompts, **params):
    return llm.generate(prompts, SamplingParams(**{**SAMPLED, **params}), use_tqdm=False)


@torch.inference_mode()
def hf_cumulative(path: str, prompt: list[int], tokens: list[int]) -> float:
    """Sum of the float32 log-softmax of HF's raw logits at each generated token (teacher-forced)."""
    logits = hf_model(path)(torch.tensor([prompt + tokens])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return lp[torch.arange(len(tokens)), torch.tensor(tokens)].sum().item()


def test_n_seeded_equals_the_n_seeded_requests(llm):
    out = gen(llm, PROMPT, n=3, seed=100)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    seeded = [SamplingParams(seed=100 + i, **SAMPLED) for i in range(3)]
    alone = [r.outputs[0] for r in llm.generate([PROMPT] * 3, seeded, use_tqdm=False)]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in alone]
    assert [o.text for o in out.outputs] == [o.text for o in alone]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # the children drew differently
    # in a batch with other requests, the same again
    batch = llm.generate(
        [PROMPT, "import os", PROMPT],
        [SamplingParams(n=3, seed=100, **SAMPLED), SamplingParams(**SAMPLED), SamplingParams(n=2, seed=101, **SAMPLED)],
        use_tqdm=False,
    )
    assert [o.token_ids for o in batch[0].outputs] == [o.token_ids for o in out.outputs]
    assert [o.token_ids for o in batch[2].outputs] == [o.token_ids for o in alone[1:]]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_best_of_keeps_the_highest_cumulative_logprobs(llm):
    path = llm.model_path
    ids = llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    seeded = [SamplingParams(seed=7 + i, logprobs=0, **SAMPLED) for i in range(4)]
    alone = [r.outputs[0] for r in llm.generate([PROMPT] * 4, seeded, use_tqdm=False)]
    for o in alone:  # the cumulative logprob is the model's own, in float32
        assert o.cumulative_logprob == pytest.approx(hf_cumulative(path, ids, o.token_ids), abs=1e-3)
    out = gen(llm, PROMPT, n=2, best_of=4, seed=7)[0]
    best = sorted(alone, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.index for o in out.outputs] == [0, 1]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in best]
    assert [o.cumulative_logprob for o in out.outputs] == pytest.approx([o.cumulative_logprob for o in best], abs=1e-4)
    assert all(o.logprobs is None for o in out.outputs)  # the user asked for none


def test_logprobs_and_prompt_logprobs_shapes(llm):
    tok = llm.get_tokenizer()
    out = gen(llm, PROMPT, n=2, seed=3, logprobs=3, prompt_logprobs=2)[0]
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for j, d in enumerate(out.prompt_logprobs[1:], start=1):
        assert next(iter(d)) == ids[j] and len(d) in (2, 3)
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        for t, d in zip(o.token_ids, o.logprobs, strict=True):
            assert next(iter(d)) == t and len(d) in (3, 4)
            assert d[t].decoded_token == tok.decode([t])
            among = len(d) == 3  # the token is one of the top 3: the others hold the other ranks
            others = sorted(lp.rank for tid, lp in d.items() if tid != t)
            assert others == [r for r in (1, 2, 3) if not (among and r == d[t].rank)]
        assert o.cumulative_logprob == pytest.approx(
            sum(d[t].logprob for t, d in zip(o.token_ids, o.logprobs, strict=True))
        )


def test_more_samples_than_sequence_slots_run_in_waves(llm, tiny_models):
    """n (or best_of) past max_num_seqs=8 runs in waves of 8: each sample is the one a single wave
    draws (seed + index, compared with an engine of 32 slots), the later waves' prompts come from the
    prefix cache, and only n past MAX_SAMPLES or a beam width past max_num_seqs is refused."""
    from pagedllm.engine.input_processor import MAX_SAMPLES

    assert llm.engine.input_processor.max_num_seqs == 8  # LLMEngine hands the scheduler's limit to the checks
    long_prompt = PROMPT + " # the n-th Fibonacci number, computed iteratively in O(n) time" * 2  # > 2 blocks
    hits = llm.get_metrics()["prefix_cache_hit_tokens"]
    waves = gen(llm, long_prompt, n=20, seed=7)[0]
    assert [o.index for o in waves.outputs] == list(range(20))
    assert llm.get_metrics()["prefix_cache_hit_tokens"] > hits  # waves 2 and 3 found the prompt cached
    with LLM(tiny_models["qwen3"], device="cpu", num_kv_blocks=256, block_size=8, max_num_seqs=32) as one:
        single = gen(one, long_prompt, n=20, seed=7)[0]
    assert [o.token_ids for o in waves.outputs] == [o.token_ids for o in single.outputs]
    best = gen(llm, PROMPT, n=2, best_of=12, seed=3)[0]  # best_of over two waves keeps the 2 best
    assert len(best.outputs) == 2 and best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob
    for params, name in [(dict(n=MAX_SAMPLES + 1), "n"), (dict(n=2, best_of=MAX_SAMPLES + 1), "best_of")]:
        with pytest.raises(InvalidRequestError) as e:
            gen(llm, PROMPT, **params)
        assert e.value.param == name
    with pytest.raises(InvalidRequestError, match="max_num_seqs=8") as e:
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=9, max_tokens=2))
    assert e.value.param == "n"
    assert not llm.engine.has_unfinished_requests()
