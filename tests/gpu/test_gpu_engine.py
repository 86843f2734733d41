"""GPU path against the CPU reference (run with `pytest -m gpu`)."""
import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import FAMILIES
from tests.model.test_hf_agreement import workload

pytestmark = pytest.mark.gpu


def greedy(llm, prompts, max_tokens):
    outs = llm.generate(prompts, [SamplingParams(temperature=0, ignore_eos=True, max_tokens=m) for m in max_tokens],
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_fp32_gpu_greedy_equals_cpu(tiny_models, family, enforce_eager):
    prompts, max_tokens = workload(3, n=10)
    cpu = LLM(tiny_models[family], device="cpu", num_kv_blocks=256, block_size=16)
    gpu = LLM(tiny_models[family], device="cuda", dtype="float32", num_kv_blocks=256, block_size=16,
              max_num_seqs=16, max_num_batched_tokens=64, enforce_eager=enforce_eager)
    assert greedy(gpu, prompts, max_tokens) == greedy(cpu, prompts, max_tokens)
    m = gpu.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_close_to_fp32(tiny_models, family):
    prompts, _ = workload(4, n=6)
    logits = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(tiny_models[family], device="cuda", dtype=dtype, num_kv_blocks=128, enforce_eager=True)
        captured = []
        real = llm.runner.sample
        llm.runner.sample = lambda lg, inp: (captured.append(lg.float().clone()), real(lg, inp))[1]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        logits[dtype] = torch.cat(captured)
    a, b = logits["bfloat16"], logits["float32"]
    rel = (a - b).norm() / b.norm()
    assert rel < 2e-2, rel


def test_profiled_kv_sizing_and_preemption_free_all(tiny_models):
    llm = LLM(tiny_models["qwen3"], device="cuda", gpu_memory_utilization=0.3, max_num_batched_tokens=512)
    assert llm.runner.num_kv_blocks > 1000
    prompts, max_tokens = workload(5, n=32)
    greedy(llm, prompts, max_tokens)
    m = llm.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
