"""fp8 KV cache on the GPU (run with `pytest -m gpu`): the Triton store and attention kernels
inside the engine, with CUDA graphs, eager, async scheduling and chunked prefill, against
each other and against the CPU path (torch references) over the same scales."""

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.model.test_kv_fp8 import PROMPTS, assert_forks_equal_the_seeded_requests, prompt_token_logprobs

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
MODES = {
    "graphs": dict(),
    "eager": dict(enforce_eager=True),
    "graphs+async": dict(async_scheduling=True),
    "chunked": dict(max_num_batched_tokens=16),
    "no-prefix-cache": dict(enable_prefix_caching=False),
}


def build(path, kv, **kw):
    base = dict(device="cuda", dtype="float32", num_kv_blocks=128, block_size=16, max_num_seqs=16)
    return LLM(path, kv_cache_dtype=kv, **{**base, **kw})


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_gpu_fp8_paths_agree_and_free_every_block(tiny_models, kv):
    tokens = {}
    for mode, kw in MODES.items():
        llm = build(tiny_models["qwen3"], kv, **kw)
        assert llm.runner.kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        m = llm.get_metrics()
        assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
        del llm
        torch.cuda.empty_cache()
    for mode, t in tokens.items():
        assert t == tokens["graphs"], mode


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_gpu_fp8_matches_the_cpu_reference(tiny_models, family):
    """Same seed, same calibration batch, so (up to fp32 rounding of the measured ranges) the
    same scales; the Triton kernels then read what the torch references read."""
    cpu = LLM(tiny_models[family], device="cpu", kv_cache_dtype="fp8", num_kv_blocks=128, block_size=16)
    gpu = build(tiny_models[family], "fp8")
    flat = lambda llm: [x for pair in llm.runner.kv_scales for x in pair]  # noqa: E731
    assert flat(gpu) == pytest.approx(flat(cpu), rel=1e-4)
    diff = (prompt_token_logprobs(gpu) - prompt_token_logprobs(cpu)).abs()
    assert diff.mean() < 5e-3 and diff.max() < 0.1, (diff.mean(), diff.max())


def test_gpu_fp8_copy_on_write_forks_equal_the_seeded_requests(tiny_models):
    """The Triton copy-on-write kernel copies fp8 blocks through their byte view."""
    assert_forks_equal_the_seeded_requests(build(tiny_models["qwen3"], "fp8", block_size=8))
