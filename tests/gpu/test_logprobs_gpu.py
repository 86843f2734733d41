"""Logprobs, prompt logprobs and parallel sampling on CUDA (Triton kernels, CUDA graphs, async
scheduling, Philox sampling), against HF transformers in float32 on the CPU. Run with
`pytest -m gpu`."""

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import FAMILIES
from tests.model.test_logprobs import check_generated, check_prompt, prompts, run_core

pytestmark = pytest.mark.gpu

MODES = {
    "graphs": dict(),
    "graphs+async": dict(async_scheduling=True),
    "eager": dict(enforce_eager=True),
}


def gpu_llm(path, mode="graphs+async", **kw):
    args = dict(device="cuda", dtype="float32", num_kv_blocks=128, block_size=8, max_num_seqs=16)
    return LLM(path, **{**args, **MODES[mode], **kw})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_ragged_batch_logprobs_match_hf(tiny_models, family, mode):
    path = tiny_models[family]
    llm = gpu_llm(path, mode, max_num_batched_tokens=16)
    assert (llm.runner.graphs is None) == (mode == "eager") and llm.runner.philox_sampling
    p = prompts(1, [11, 37, 5, 20])
    got = run_core(
        llm,
        {
            "greedy": (p[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)),
            "prompt": (p[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=4)),
            "plain": (p[2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
            "hot": (p[3], SamplingParams(temperature=0.7, top_k=3, seed=7, max_tokens=6, ignore_eos=True, logprobs=2)),
        },
    )
    check_generated(path, p[0], got["greedy", 0], 5)
    assert all(e.rank == 1 for e in got["greedy", 0]["logprobs"])
    check_generated(path, p[3], got["hot", 0], 2)
    assert all(e.rank <= 3 for e in got["hot", 0]["logprobs"])
    check_prompt(path, p[1], got["prompt", 0]["prompt"], 4)
    assert got["plain", 0]["logprobs"] == [None] * 5
    m = llm.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]


@pytest.mark.parametrize("sampler", ["philox", "torch"])
@pytest.mark.parametrize("prompt_len", [13, 16])
def test_gpu_parallel_sampling_children_equal_seeded_requests_alone(tiny_models, monkeypatch, sampler, prompt_len):
    """Temperature only: the fused Gumbel kernel on the Philox path; copy-on-write through the
    Triton copy kernel before graph-replayed decodes."""
    if sampler == "torch":
        monkeypatch.setenv("PAGEDLLM_SAMPLER", "torch")
    path = tiny_models["qwen3"]
    p, other = prompts(4, [prompt_len, 10])
    hot = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    alone = [run_core(gpu_llm(path), {"r": (p, SamplingParams(seed=41 + i, **hot))})["r", 0] for i in range(3)]
    llm = gpu_llm(path)
    assert llm.runner.philox_sampling == (sampler == "philox")
    got = run_core(
        llm,
        {"n3": (p, SamplingParams(n=3, seed=41, logprobs=1, **hot)), "company": (other, SamplingParams(seed=5, **hot))},
    )
    assert len({tuple(a["tokens"]) for a in alone}) == 3
    for i in range(3):
        assert got["n3", i]["tokens"] == alone[i]["tokens"]
        check_generated(path, p, got["n3", i], 1)
    m = llm.get_metrics()
    assert (m["num_copy_on_write_blocks"] > 0) == (prompt_len % 8 != 0)
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]


@pytest.mark.parametrize("mode", ["graphs", "graphs+async"])
def test_gpu_greedy_n2_from_a_cached_prompt_equals_n1(tiny_models, mode):
    """The second request hits its whole prompt but the last token in the prefix cache, so the step
    that forks it is decode-only (a CUDA graph) with one hidden row sampled twice."""
    path = tiny_models["llama"]
    (p,) = prompts(5, [17])
    greedy = dict(temperature=0, max_tokens=10, ignore_eos=True)
    llm = gpu_llm(path, mode)
    one = run_core(llm, {"warm": (p, SamplingParams(**greedy))})["warm", 0]["tokens"]
    got = run_core(llm, {"n2": (p, SamplingParams(n=2, logprobs=0, **greedy))})
    assert got["n2", 0]["tokens"] == got["n2", 1]["tokens"] == one
    m = llm.get_metrics()
    assert m["prefix_cache_hit_tokens"] >= 16 and m["num_copy_on_write_blocks"] > 0
    for i in range(2):
        check_generated(path, p, got["n2", i], 0)
