"""The throughput benchmark's workload and step timer (CUDA events faked so it runs on CPU; under
tensor parallelism: tests/tp/test_tp_logprobs.py, on that module's TP=2 engine)."""

import time

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench import throughput


def test_workload_is_nano_vllms():
    prompts, params = throughput.workload()
    assert len(prompts) == 256 and sum(p.max_tokens for p in params) == throughput.TOTAL_OUTPUT_TOKENS
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(p.temperature == 0.6 and p.ignore_eos for p in params)
    first, _ = throughput.workload(8)
    assert first == prompts[:8]


class FakeEvent:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_timer_splits_time_by_step_kind(tiny_models, monkeypatch, tmp_path, async_scheduling):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    llm = LLM(tiny_models["qwen3"], num_kv_blocks=256, block_size=8, async_scheduling=async_scheduling)
    timer = throughput.StepTimer(llm)
    profile = tmp_path / "profile.txt"
    timer.profile("1:3", str(profile))
    outs = llm.generate([[1, 2, 3]] * 5, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    kinds = timer.summary()["time_by_step_kind"]
    assert kinds["prefill_or_mixed"]["steps"] >= 1 and kinds["decode_batch_1_16"]["steps"] == 5
    assert all(k["wall_s"] >= 0 and k["gpu_s"] >= 0 for k in kinds.values())
    assert "aten::" in profile.read_text()  # the profiled window's op table


def test_bench_throughput_needs_a_model_for_its_token_ids():
    import argparse

    p = argparse.ArgumentParser()
    throughput.add_args(p)
    with pytest.raises(ValueError, match="--model"):
        throughput.main(p.parse_args(["--skip-pagedllm"]))


def test_a_result_row_names_the_kernel_switches_set_and_nothing_else(monkeypatch):
    """pagedllm/bench/common.py: environment() records the PAGEDLLM_ switches that change which kernels
    run (a row measured with PAGEDLLM_DECODE_GEMM=cublas says so), never other variables such as the API key."""
    from pagedllm.bench.common import KERNEL_SWITCHES, environment

    for name in KERNEL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert "settings" not in environment()
    monkeypatch.setenv("PAGEDLLM_DECODE_GEMM", "cublas")
    monkeypatch.setenv("PAGEDLLM_SAMPLER", "torch")
    monkeypatch.setenv("PAGEDLLM_API_KEY", "secret")
    assert environment()["settings"] == {"PAGEDLLM_DECODE_GEMM": "cublas", "PAGEDLLM_SAMPLER": "torch"}
