"""The decode GEMM's fused forms inside the model: a step of a few rows whose input norms run inside
the qkv and gate_up launches (ops/decode_gemm.py's `linear_norm`) and whose activation runs inside
the down projection's (`linear_act`) gives the logits of the same layers run apart.

On a GPU the decode GEMM takes bf16 / fp16 rows (tests/gpu/test_gpu_engine.py compares a decode
step against cuBLAS). Here, without one, its `wanted` is widened to float32 CPU tensors, so every
linear layer of a step of at most MAX_ROWS rows runs the kernel in Triton's interpreter (IEEE
float32 dots), and the logits must match the unfused float32 forward within summation order. The
families cover the norm's forms and placements: Qwen3 (q/k norms, the first layer's norm without a
residual), Qwen2 (qkv biases after the norm) and Gemma 3 (the (1 + w) form, the MLP's norm after
the post-attention norm of the sandwich, GeGLU)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pagedllm.ops import decode_gemm as dg
from tests.model.families import family_checkpoints, ours, prefill_logits

# the interpreter runs kernels only where CUDA is absent (ops/_triton.py); on a GPU,
# tests/gpu/test_gpu_engine.py runs the compiled kernel in bf16 decode graphs
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton interprets kernels only without CUDA")


@pytest.fixture(scope="module")
def paths(tiny_models, tmp_path_factory):
    gemma3 = family_checkpoints(tiny_models["qwen3"], tmp_path_factory)["gemma3"]
    return {"qwen3": tiny_models["qwen3"], "qwen2": tiny_models["qwen2"], "gemma3": gemma3}


def logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    return prefill_logits(ours(path), ids)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "gemma3"])
def test_norms_and_activations_inside_the_gemms_give_the_layers_logits(paths, kind, monkeypatch):
    """Without PAGEDLLM_DECODE_FUSION every projection is a plain decode GEMM; with it the norms and
    the activation move inside the launches; both give the float32 forward's logits."""
    from transformers import AutoConfig

    monkeypatch.delenv("PAGEDLLM_DECODE_FUSION", raising=False)
    layers = AutoConfig.from_pretrained(paths[kind]).num_hidden_layers
    ids = torch.randint(1, 200, (dg.MAX_ROWS - 3,), generator=torch.Generator().manual_seed(5))
    apart = logits(paths[kind], ids)

    launches: Counter[str] = Counter()
    launch = dg._launch

    def counted(x, weight, bias, config, counters, act, norm):
        launches["norm" if norm is not None else "act" if act else "plain"] += 1
        if norm is not None:
            launches["norm with residual"] += norm.residual is not None
        return launch(x, weight, bias, config, counters, act, norm)

    monkeypatch.setattr(dg, "_launch", counted)
    monkeypatch.setattr(dg, "wanted", lambda x, w: x.dtype == torch.float32 and x.numel() // x.shape[-1] <= dg.MAX_ROWS)
    plain = logits(paths[kind], ids)
    assert set(launches) == {"plain"} and launches["plain"] >= 4 * layers  # the four projections, plain
    torch.testing.assert_close(plain, apart, rtol=1e-4, atol=1e-4)

    launches.clear()
    monkeypatch.setenv("PAGEDLLM_DECODE_FUSION", "1")
    fused = logits(paths[kind], ids)
    # per layer: qkv and gate_up with their norms, the down projection with its activation, o alone
    assert launches["norm"] == 2 * layers and launches["act"] == layers and launches["plain"] >= layers
    assert launches["norm with residual"] == 2 * layers - 1  # the first norm starts the residual stream
    torch.testing.assert_close(fused, apart, rtol=1e-4, atol=1e-4)
