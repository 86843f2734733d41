"""RMSNorm in fp32 as HF computes it, with the residual add fused into the same call
(the arithmetic is ops/fused_ref.py's, or its Triton kernel's on GPU). Gemma's form
(unit_offset) stores w and scales by 1 + w, as its checkpoints do.

`norm_then_project`: a norm and the projection it feeds (qkv, gate_up), in one launch where the
decode GEMM takes the product (a decode step's few rows on CUDA: ops/decode_gemm.py's `linear_norm`)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.linear import ColumnParallelLinear
from pagedllm.ops.decode_gemm import NormIn
from pagedllm.ops.kernels import Kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, kernels: Kernels, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.kernels = kernels
        self.weight = nn.Parameter(torch.zeros(hidden) if unit_offset else torch.ones(hidden), requires_grad=False)
        # only Gemma's norms pass the keyword: the plain calls stay those of the Kernels protocol's first form
        self._form: dict[str, bool] = {"unit_offset": True} if unit_offset else {}

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps, **self._form)
        return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps, **self._form)


def norm_then_project(
    norm: RMSNorm, proj: ColumnParallelLinear, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(proj(norm(x + residual)), x + residual); without a residual (a model's first norm) the
    residual stream starts as x itself."""
    fused = proj.forward_norm(x, NormIn(norm.weight, norm.eps, norm.unit_offset, residual))
    if fused is not None:
        return fused
    if residual is None:
        residual, x = x, norm(x)
    else:
        x, residual = norm(x, residual)
    return proj(x), residual
