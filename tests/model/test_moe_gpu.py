"""The MoE families on the GPU (the fused Triton experts kernel inside the engine, captured in CUDA
graphs) against HF transformers' greedy tokens, float32 (run with `pytest -m gpu`)."""

import pytest

from pagedllm import LLM, SamplingParams
from tests.model.families import long_workload
from tests.model.hf_reference import GREEDY, hf_position_logits
from tests.model.test_moe import MOE_KINDS, moe_checkpoints

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    return moe_checkpoints(tiny_models["qwen3"], tmp_path_factory)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_fp32_gpu_greedy_equals_hf(checkpoints, kind):
    """Prefill chunks run eagerly, decode steps in CUDA graphs: both paths of the kernels."""
    path = checkpoints[kind]
    prompts, max_tokens = long_workload()
    max_tokens = [m + 16 for m in max_tokens]  # decode steps in graphs of several batch sizes
    llm = LLM(
        path,
        device="cuda",
        dtype="float32",
        num_kv_blocks=128,
        block_size=16,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens], use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        ids = prompt + got
        assert got == hf_position_logits(path, ids)[len(prompt) - 1 : len(ids) - 1].argmax(-1).tolist()
    m = llm.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
