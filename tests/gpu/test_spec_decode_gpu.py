"""Speculative decoding on CUDA with the defaults (CUDA graphs: decode graphs for plain decode
steps, whole-step / piecewise graphs or eager for verification steps; async scheduling on, a
step that proposes run synchronously) and eager: greedy with n-gram speculation equals greedy
without, token for token, with proposals accepted; also under forced preemption, for the
bundled model, and for seeded sampling on the fused Philox sampler (a seeded row's draw is keyed
by (seed, position), so the same tokens come out). Run with `pytest -m gpu`."""

from __future__ import annotations

import dataclasses

import pytest

from pagedllm import LLM, SamplingParams, default_model_path
from tests.model.test_spec_decode_llm import SPEC, greedy, workload

pytestmark = pytest.mark.gpu

CUDA = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=256, max_model_len=512)


def both(path: str, prompts, **kw):
    """Speculation never pauses here (spec_decode.Backoff would, on the tiny models' rarely copying
    outputs): every decode step that finds a proposal verifies it."""
    outs = []
    for spec in (None, SPEC):
        with LLM(path, **{**CUDA, **kw}, speculative_config=spec) as llm:
            if spec is not None:
                llm.engine.scheduler.speculator.backoff.FLOOR = 0.0
            outs.append(greedy(llm, prompts, 48))
            m = llm.get_metrics()
            assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
            assert llm.engine.async_scheduling  # the CUDA default, with speculation too
            if spec is not None:
                assert m["spec_decode_num_accepted_tokens"] > 0, m
    return outs, m


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("mode", [dict(), dict(enforce_eager=True)], ids=str)
def test_greedy_with_speculation_equals_without_on_cuda(tiny_models, family, mode):
    (plain, spec), _ = both(tiny_models[family], workload(200, seed=1) * 3, **mode)
    assert spec == plain


def test_under_preemption_and_for_the_bundled_model(tiny_models):
    (plain, spec), m = both(tiny_models["qwen3"], workload(200, seed=2) * 2, num_kv_blocks=24, max_num_seqs=12)
    assert spec == plain and m["num_preemptions"] > 0
    with LLM(default_model_path(), **CUDA) as llm:
        ids = llm.tokenizer.encode("one two three four, one two three four, one two three four, one two")
        prompts = [ids, ids[3:], workload(llm.hf_config.vocab_size, seed=4)[1]]
    (plain, spec), _ = both(default_model_path(), prompts)
    assert spec == plain


def test_seeded_sampling_draws_the_same_tokens_on_cuda(tiny_models):
    prompts = workload(200, seed=3)
    params = [SamplingParams(temperature=0.9, seed=50 + i, max_tokens=32) for i in range(len(prompts))]
    for extra in (dict(), dict(top_p=0.9, min_p=0.02)):  # the fused Gumbel kernel, then the torch path on Philox noise
        ps = [dataclasses.replace(p, **extra) for p in params]
        outs = []
        for spec in (None, SPEC):
            with LLM(tiny_models["qwen3"], **CUDA, speculative_config=spec) as llm:
                if spec is not None:
                    llm.engine.scheduler.speculator.backoff.FLOOR = 0.0
                res = llm.generate([{"prompt_token_ids": p} for p in prompts], ps, use_tqdm=False)
                outs.append([o.outputs[0].token_ids for o in res])
        assert outs[1] == outs[0]
