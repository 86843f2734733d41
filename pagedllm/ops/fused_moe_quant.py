"""The quantized fused MoE on CUDA: FP8 stacks to ops/fused_moe_fp8.py, 4-bit ones to
ops/fused_moe_int4.py (both stacks of one kind; ops/moe_quant.py: quant_moe_ref's contract)."""

from __future__ import annotations

import torch

from pagedllm.ops.fused_moe_fp8 import fused_moe_fp8
from pagedllm.ops.fused_moe_int4 import fused_moe_int4
from pagedllm.ops.moe_quant import ExpertStack, Fp8Stack, Int4Stack


def fused_moe_quant(
    x: torch.Tensor, w13: ExpertStack, w2: ExpertStack, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    if isinstance(w13, Fp8Stack) and isinstance(w2, Fp8Stack):
        return fused_moe_fp8(x, w13, w2, topk_weights, topk_ids)
    assert isinstance(w13, Int4Stack) and isinstance(w2, Int4Stack), (type(w13), type(w2))
    return fused_moe_int4(x, w13, w2, topk_weights, topk_ids)
