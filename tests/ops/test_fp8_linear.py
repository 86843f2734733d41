"""ops/fp8_linear.py: per-token activation and per-channel weight scales; the CUDA path
(`torch._scaled_mm`) against the float32 reference on the same quantized operands."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops.fp8_linear import (
    FP8,
    fp8_linear,
    fp8_linear_ref,
    quantize_rows,
    quantize_rows_triton,
    quantize_weight,
)


def test_rows_quantize_to_their_own_scale_and_zero_rows_stay_zero():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1e-3, 4e-3, -2e-3]])
    q, s = quantize_rows(x)
    assert q.dtype == FP8 and s.shape == (3, 1)
    assert float(q.float().abs().amax(dim=-1)[0]) == 448.0 and float(q.float().abs().amax(dim=-1)[2]) == 448.0
    assert torch.equal(q[1].float(), torch.zeros(3))
    torch.testing.assert_close(q.float() * s, x, rtol=0.07, atol=0)  # e4m3: 3 mantissa bits


def test_reference_is_the_product_of_the_dequantized_operands():
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 32), torch.randn(24, 32), torch.randn(24)
    wq, ws = quantize_weight(w)
    xq, xs = quantize_rows(x)
    want = (xq.float() * xs) @ (wq.float() * ws[:, None]).t() + b
    torch.testing.assert_close(fp8_linear_ref(x, wq, ws, b), want)
    torch.testing.assert_close(fp8_linear(x, wq, ws, b), want)  # CPU: the reference itself
    assert fp8_linear_ref(x.view(1, 5, 32), wq, ws).shape == (1, 5, 24)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_path_matches_the_reference(m, dtype):
    torch.manual_seed(m)
    x = torch.randn(m, 256, device="cuda", dtype=dtype)
    w, b = torch.randn(384, 256, device="cuda"), torch.randn(384, device="cuda", dtype=dtype)
    wq, ws = quantize_weight(w)
    got = fp8_linear(x, wq, ws, b).float()
    want = fp8_linear_ref(x.float(), wq, ws, b.float())
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # the GEMM writes bf16


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1024), (37, 3072), (256, 1024), (5, 100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_quantize_kernel_writes_the_bytes_of_the_torch_quantizer(shape, dtype):
    """The Triton kernel's activations and scales are bit-identical to quantize_rows' (an
    all-zero row included). GPU only: Triton's interpreter rounds float32 -> fp8 differently."""
    torch.manual_seed(shape[0])
    x = torch.randn(shape, device="cuda", dtype=dtype) * torch.rand(shape[0], 1, device="cuda", dtype=dtype) * 30
    x[0] = 0
    q, s = quantize_rows_triton(x)
    q_ref, s_ref = quantize_rows(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
