"""Speculative decoding on CUDA with the defaults (CUDA graphs: decode graphs for plain decode
steps, whole-step / piecewise graphs or eager for verification steps; async scheduling on, a
step that proposes run synchronously) and eager: greedy with n-gram speculation equals greedy
without, token for token, with proposals accepted; also under forced preemption, for the
bundled model, and for seeded sampling on the fused Philox sampler (a seeded row's draw is keyed
by (seed, position), so the same tokens come out). The same with a draft model (the target as its
own draft, a draft of another family, the bundled model). Run with `pytest -m gpu`."""

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


# ---- draft-model speculation (worker/draft_model.py): the draft runs before the target's step (its
# single-token forwards through its own decode graphs, worker/draft_graphs.py, unless eager), and the
# verification rows run through the same graphs (or eagerly) as n-gram ones


def both_draft(path: str, draft_dir: str, prompts, k: int = 3, max_tokens: int = 48, **kw):
    outs, m = [], {}
    for spec in (None, {"model": draft_dir, "num_speculative_tokens": k, "disable_by_batch_size": None}):
        with LLM(path, **{**CUDA, **kw}, speculative_config=spec) as llm:
            if spec is not None:
                llm.engine.scheduler.speculator.backoff.FLOOR = 0.0
            outs.append(greedy(llm, prompts, max_tokens))
            m = llm.get_metrics()
            assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
    return outs, m


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("mode", [dict(), dict(enforce_eager=True)], ids=str)
def test_the_target_as_its_own_draft_on_cuda(tiny_models, family, mode):
    """float32: the draft's single-token steps and the target's verification rows compute the same
    logits up to rounding, so (nearly) every proposal is accepted; the output is the same exactly."""
    path = tiny_models[family]
    (plain, spec), m = both_draft(path, path, workload(200, seed=1) * 3, **mode)
    assert spec == plain
    assert m["spec_decode_num_drafts"] > 0 and m["spec_decode_acceptance_rate"] > 0.9, m


def test_a_draft_under_preemption_another_family_and_the_bundled_model(tiny_models):
    path = tiny_models["qwen3"]
    (plain, spec), m = both_draft(path, path, workload(200, seed=2) * 2, num_kv_blocks=24, max_num_seqs=12)
    assert spec == plain and m["num_preemptions"] > 0 and m["spec_decode_acceptance_rate"] > 0.9, m
    (plain, spec), m = both_draft(path, tiny_models["llama"], workload(200, seed=3), k=2)
    assert spec == plain and m["spec_decode_num_drafts"] > 0
    bundled = default_model_path()
    with LLM(bundled, **CUDA) as llm:
        ids = llm.tokenizer.encode("one two three four, one two three four, one two")
    (plain, spec), m = both_draft(bundled, bundled, [ids, ids[3:]])
    assert spec == plain and m["spec_decode_num_accepted_tokens"] > 0


def test_seeded_sampling_with_a_draft_on_cuda(tiny_models):
    path = tiny_models["qwen3"]
    prompts = workload(200, seed=3)
    params = [SamplingParams(temperature=0.9, seed=50 + i, max_tokens=32) for i in range(len(prompts))]
    outs = []
    for spec in (None, {"model": path, "num_speculative_tokens": 3, "disable_by_batch_size": None}):
        with LLM(path, **CUDA, speculative_config=spec) as llm:
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            outs.append([o.outputs[0].token_ids for o in res])
            if spec is not None:
                assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0
    assert outs[1] == outs[0]


def test_the_drafts_single_token_forwards_replay_its_graphs(tiny_models):
    """With graphs, the draft's decode forwards are replays (up to disable_by_batch_size sequences),
    and the output is still the target's own."""
    path = tiny_models["qwen3"]
    prompts = workload(200, seed=4)[:6]
    with LLM(path, **CUDA) as llm:
        plain = greedy(llm, prompts, 40)
    spec = {"model": path, "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    with LLM(path, **CUDA, max_num_seqs=16, speculative_config=spec) as llm:
        llm.engine.scheduler.speculator.backoff.FLOOR = 0.0
        graphs = llm.runner.draft.graphs
        assert graphs is not None and graphs.sizes[-1] == 8
        replays = []
        real = graphs.run
        graphs.run = lambda rows, fix=None: (replays.append(rows.num_seqs), real(rows, fix))[1]
        assert greedy(llm, prompts, 40) == plain
        m = llm.get_metrics()
    assert replays and max(replays) == len(prompts)
    assert m["spec_decode_acceptance_rate"] > 0.9, m
