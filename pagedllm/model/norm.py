"""RMSNorm in fp32 as HF computes it, with the residual add fused into the same call
(the arithmetic is ops/fused_ref.py's, or its Triton kernel's on GPU)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.ops.kernels import Kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, kernels: Kernels):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
