"""FP8 linear layers for `quantization="fp8"` (vLLM's on-the-fly FP8): weights quantized at load,
activations at run time.

- Weights: e4m3, one scale per output channel (row of W [N, K]): w_scale[n] = max|W[n, :]| / 448,
  Wq = saturate(W / w_scale). Quantized once, after loading (and after the TP shard is cut, so
  each rank's rows keep their own scales).
- Activations: one scale per token (row of x [M, K]), computed in every forward:
  x_scale[m] = max|x[m, :]| / 448, xq = saturate(x / x_scale).
- y = (xq * x_scale) @ (Wq * w_scale)^T (+ bias): on CUDA one `torch._scaled_mm` with row-wise
  scales (an fp8 tensor-core GEMM, bf16 out); elsewhere the same product computed in float32
  from the dequantized operands (the reference the GPU path is tested against).

On CUDA the activations are quantized by one Triton kernel (`quantize_rows_triton`: a program per
row, the same IEEE operations as `quantize_rows`, so the same bytes) instead of the seven torch
ops of `quantize_rows`.
"""

from __future__ import annotations

import torch

from pagedllm.ops._triton import HAS_TRITON, next_pow2, tl, triton

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))  # scale = amax * this, in float32
MIN_SCALE = 1e-12  # an all-zero row: any positive scale gives zeros; this one avoids 0/0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (e4m3 [R, K], float32 scales [R, 1]) with one scale per row."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) * INV_FP8_MAX).clamp_(min=MIN_SCALE)
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


if HAS_TRITON:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, inv_max, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) * inv_max, 1e-12)  # MIN_SCALE
        y = tl.clamp(tl.div_rn(x, scale), -448.0, 448.0)
        tl.store(q_ptr + row * stride_q + offs, y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(s_ptr + row, scale)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` in one kernel launch (CUDA): x [R, K] with unit stride along K."""
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = next_pow2(k)
        _quantize_rows_kernel[(rows,)](
            x, q, scale, k, x.stride(0), q.stride(0), INV_FP8_MAX, BLOCK=block, num_warps=8 if block >= 2048 else 4
        )
    return q, scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (e4m3 [N, K] contiguous, float32 per-output-channel scales [N])."""
    wq, scale = quantize_rows(weight)
    return wq.contiguous(), scale.view(-1)


def _product(
    x: torch.Tensor,
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    scaled_mm: bool,
) -> torch.Tensor:
    """(xq * x_scale) @ (wq * w_scale)^T (+ bias) in x's dtype and shape: xq [M, K] e4m3 with row scales
    x_scale [M, 1]; `torch._scaled_mm` (an fp8 tensor-core GEMM, bf16 out) or float32 from the dequantized
    operands (the reference)."""
    if scaled_mm:
        y = torch._scaled_mm(
            xq,
            wq.t(),  # column-major [K, N], as the kernel wants its second operand
            scale_a=x_scale,
            scale_b=w_scale.view(1, -1),
            bias=None,
            out_dtype=torch.bfloat16,  # row-wise scaling writes bf16; cast below for fp16/fp32 models
        )
        if bias is not None:
            y = y + bias
    else:
        y = (xq.float() * x_scale) @ (wq.float() * w_scale[:, None]).t()
        if bias is not None:
            y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], wq.shape[0])


def fp8_linear_ref(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The product in float32 from the dequantized operands, in x's dtype: [..., K] -> [..., N]."""
    xq, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return _product(x, xq, x_scale, wq, w_scale, bias, scaled_mm=False)


def fp8_linear(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x W^T (+ bias) with W in fp8: `torch._scaled_mm` on CUDA, the reference elsewhere."""
    if x.device.type != "cuda":
        return fp8_linear_ref(x, wq, w_scale, bias)
    x2 = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_rows_triton(x2) if HAS_TRITON and x2.stride(-1) == 1 else quantize_rows(x2)
    return _product(x, xq, x_scale, wq, w_scale, bias, scaled_mm=True)


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [R, K] -> e4m3 with one given per-tensor scale (a checkpoint's `input_scale`)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_linear_static(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`fp8_linear` with static activations: every token quantized with the one scale `x_scale`."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x_scale.reshape(1, 1).expand(x2.shape[0], 1).contiguous()  # the per-tensor scale as row scales
    return _product(x, quantize_static(x2, x_scale), rows, wq, w_scale, bias, scaled_mm=x.device.type == "cuda")
