"""RMSNorm in fp32 as HF computes it, with the residual add fused into the same call."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if x.is_cuda:  # one fused Triton kernel instead of ~8 small ones
            from pagedllm.ops.fused import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self.norm(x)
        x = x + residual
        return self.norm(x), x
