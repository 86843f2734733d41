"""The second half of a split-K GEMM: the float32 partial sums of the splits, added in a fixed order.

A GEMM split along K (ops/int4_linear.py, ops/decode_gemm.py, for the few rows of a decode step) writes
one float32 partial [M, N] per split into a workspace [split, M, N]; `split_k_sum` adds them split 0
first, then 1, ..., adds the bias, and rounds once to the output's dtype. A fixed order, no atomics: the
same result on every run.
"""

from __future__ import annotations

import torch

from pagedllm.ops._triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _split_k_sum_kernel(
        part_ptr,  # float32 [SPLIT_K, M, N]
        bias_ptr,
        out_ptr,  # [M, N]
        N,
        stride_ps,
        stride_pm,
        stride_om,
        HAS_BIAS: tl.constexpr,
        SPLIT_K: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(SPLIT_K):  # a fixed order: the same sums on every run
            acc += tl.load(part_ptr + s * stride_ps + row * stride_pm + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def split_k_sum(parts: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] = sum over s of parts[s] (float32 [split, M, N], unit stride along N) + bias, in order."""
    split, m, n = parts.shape
    assert out.shape == (m, n) and parts.stride(2) == out.stride(1) == 1, (parts.shape, out.shape)
    block = min(1024, triton.next_power_of_2(n))
    _split_k_sum_kernel[(m, triton.cdiv(n, block))](
        parts,
        bias if bias is not None else out,
        out,
        n,
        parts.stride(0),
        parts.stride(1),
        out.stride(0),
        HAS_BIAS=bias is not None,
        SPLIT_K=split,
        BLOCK=block,
    )
