"""ops/pdl.py: programmatic dependent launch is off unless PAGEDLLM_PDL=1 on a GPU that passes the
probe, and a decode step launched with it gives the same bits as without (on the GPU, `-m gpu`)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops import pdl


def test_off_without_a_gpu_or_the_switch(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_PDL", "1")
    assert not pdl.enabled(torch.device("cpu"))  # the interpreter, or no CUDA: never
    monkeypatch.setenv("PAGEDLLM_PDL", "0")
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_options(False) == {} and pdl.launch_options(True) == {"launch_pdl": True}


def test_the_switch_is_read_when_asked(monkeypatch):
    from pagedllm import envs

    for value, on in [("1", True), ("true", True), ("0", False), ("", False)]:
        monkeypatch.setenv("PAGEDLLM_PDL", value)
        assert envs.pdl() is on
    monkeypatch.delenv("PAGEDLLM_PDL")
    assert envs.pdl() is False


@pytest.mark.gpu
def test_the_probe_passes_and_is_not_run_under_capture(monkeypatch):
    """On a Hopper GPU the probe's PDL chain in a CUDA graph counts right; `enabled` does not probe
    while a graph is being captured (a capture inside a capture fails)."""
    monkeypatch.setenv("PAGEDLLM_PDL", "1")
    index = torch.cuda.current_device()
    pdl._PROBED.pop(index, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert not pdl.enabled(torch.device("cuda"))
    assert index not in pdl._PROBED
    want = torch.cuda.get_device_capability(index)[0] >= 9
    assert pdl.enabled(torch.device("cuda")) is want


@pytest.mark.gpu
def test_a_decode_step_with_pdl_gives_the_same_bits(tiny_models, monkeypatch):
    """The same bf16 decode steps (graphs, the decode GEMM with its norms and activations, attention
    with its in-kernel merge) with and without PDL: identical logits (PDL changes when kernels start,
    not what they compute)."""
    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_DECODE_FUSION", "1")

    def first_decode_logits(setting: str) -> torch.Tensor:
        monkeypatch.setenv("PAGEDLLM_PDL", setting)
        llm = LLM(tiny_models["qwen3"], device="cuda", dtype="bfloat16", num_kv_blocks=256, max_num_seqs=8)
        assert llm.runner.pdl is (setting == "1" and torch.cuda.get_device_capability()[0] >= 9)
        captured: list[torch.Tensor] = []
        real = llm.runner.sample
        llm.runner.sample = lambda lg, inp: (captured.append(lg.float().clone()), real(lg, inp))[1]
        prompts = [list(range(5 + i, 40 + 7 * i)) for i in range(4)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        llm.close()
        return torch.stack(captured[-4:])

    assert torch.equal(first_decode_logits("1"), first_decode_logits("0"))
