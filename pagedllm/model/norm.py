"""RMSNorm in fp32 as HF computes it, with the residual add fused into the same call
(the arithmetic is ops/fused_ref.py's, or its Triton kernel's on GPU). Gemma's form
(unit_offset) stores w and scales by 1 + w, as its checkpoints do."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.ops.kernels import Kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, kernels: Kernels, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
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
