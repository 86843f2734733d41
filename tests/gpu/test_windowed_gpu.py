"""Windowed families on the GPU (Triton windowed attention, per-group block tables, the CUDA
graphs' per-group buffers) against the CPU path, past the window (run with `pytest -m gpu`)."""

import pytest

from pagedllm import LLM
from tests.gpu.test_gpu_engine import greedy
from tests.model.families import family_checkpoints, long_workload

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    return family_checkpoints(tiny_models["qwen3"], tmp_path_factory)


@pytest.mark.parametrize("kind", ["gemma3", "gemma2", "mistral"])
@pytest.mark.parametrize("mode", ["graphs", "eager", "graphs+async"])
def test_windowed_fp32_gpu_greedy_equals_cpu(checkpoints, kind, mode):
    path = checkpoints[kind]
    prompts, max_tokens = long_workload()
    max_tokens = [m + 24 for m in max_tokens]  # decode steps well past the window, in graphs
    cpu = LLM(path, device="cpu", num_kv_blocks=256, block_size=16, max_model_len=256)
    gpu = LLM(
        path,
        device="cuda",
        dtype="float32",
        num_kv_blocks=256,
        block_size=16,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        enforce_eager=mode == "eager",
        async_scheduling=mode.endswith("async"),
    )
    assert greedy(gpu, prompts, max_tokens) == greedy(cpu, prompts, max_tokens)
    m = gpu.get_metrics()
    assert len(m["kv_cache_groups"]) == (1 if kind == "mistral" else 2)
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
