"""Quantized mixture-of-experts weights (FP8, 4-bit) and their torch reference.

A stack holds one matrix W_e [N, K] per expert e, as the fused kernels read it (w13: N = 2I gate
rows then up rows, K = H; w2: N = H, K = I; I is this TP rank's slice):

- `Fp8Stack`: e4m3 `weight` [E, N, K] with float32 multipliers, one per [bn, bk] block
  (`scale` [E, N / bn, K / bk], `block` set) or one per output row (`scale` [E, N], `block` None:
  a checkpoint's per-tensor scales are spread over their rows). The activations are quantized at
  run time: per token and group of bk columns (block), or per token (rows), as the dense layers'
  (ops/fp8_block_linear.py, ops/fp8_linear.py): x before w13, the SiLU-and-mul output before w2.
- `Int4Stack`: 4-bit weight-only, each expert in the dense 4-bit kernel's layout
  (ops/int4_linear.py): `qweight` int32 [E, K / 8, N] (eight rows of W^T a word), `scales`
  [E, K / group, N], `zeros` uint8 [E, K / group, N], W^T[k, n] = (q - zero) * scale; `perm`
  int32 [E, K] or None: GPTQ's desc_act, row k of W_e^T multiplies input column perm[e, k].

`quant_moe_ref` is fused_moe_ref's contract (ops/moe_ref.py) with quantized stacks: the same
bytes dequantized, then the float matmuls, in the order the kernels (ops/fused_moe_fp8.py,
ops/fused_moe_int4.py) compute them. It is the CPU path and the kernels' oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.ops.fp8_block_linear import quantize_groups
from pagedllm.ops.fp8_linear import quantize_rows
from pagedllm.ops.int4_linear import dequantize as dequantize_int4


@dataclass(frozen=True)
class Fp8Stack:
    weight: torch.Tensor  # e4m3 [E, N, K]
    scale: torch.Tensor  # float32 [E, N / bn, K / bk] (block) or [E, N] (per output row)
    block: tuple[int, int] | None

    def dequantize(self, e: int) -> torch.Tensor:
        """W_e [N, K] in float32."""
        w = self.weight[e].float()
        if self.block is None:
            return w * self.scale[e].float()[:, None]
        bn, bk = self.block
        return w * self.scale[e].float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)


@dataclass(frozen=True)
class Int4Stack:
    qweight: torch.Tensor  # int32 [E, K / 8, N]
    scales: torch.Tensor  # [E, K / group, N]
    zeros: torch.Tensor  # uint8 [E, K / group, N]
    perm: torch.Tensor | None  # int32 [E, K]
    group: int

    def dequantize(self, e: int) -> torch.Tensor:
        """W_e [N, K] in float32, in the input's column order."""
        wt = dequantize_int4(self.qweight[e], self.scales[e], self.zeros[e], self.group)
        if self.perm is not None:
            wt = torch.empty_like(wt).index_copy_(0, self.perm[e].long(), wt)
        return wt.t()


ExpertStack = Fp8Stack | Int4Stack


def quantize_activations(x: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (e4m3 [R, K], float32 scales [R, K / bk] per token and group, or [R, 1] per token)."""
    return quantize_rows(x) if block is None else quantize_groups(x, block[1])


def _fake_quantized(x: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """x's activations as the fp8 kernel multiplies them: quantized, then dequantized (float32)."""
    q, scale = quantize_activations(x, block)
    group = x.shape[1] if block is None else block[1]
    return q.float() * scale.repeat_interleave(group, 1)


def quant_moe_ref(
    x: torch.Tensor, w13: ExpertStack, w2: ExpertStack, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """x [T, H] -> [T, H] in x's dtype: sum over each token's k experts of weight * down(silu(gate(x)) *
    up(x)), each expert's weights dequantized from its bytes. FP8: the matmuls' inputs quantized as the
    kernel quantizes them (x once, the intermediate per row after it is rounded to x's dtype); 4-bit: the
    dequantized weights rounded to x's dtype (the kernel's dot operand). Products in float32."""
    fp8 = isinstance(w13, Fp8Stack)
    a13 = _fake_quantized(x, w13.block) if isinstance(w13, Fp8Stack) else x.float()
    t, h = x.shape
    top_k = topk_ids.shape[1]
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    for e in torch.unique(flat_ids).tolist():
        rows = (flat_ids == e).nonzero().squeeze(1)  # positions in the [T * k] flattening
        tokens = rows // top_k
        g13, g2 = w13.dequantize(e), w2.dequantize(e)
        if not fp8:
            g13, g2 = g13.to(x.dtype).float(), g2.to(x.dtype).float()
        gate_up = a13[tokens] @ g13.t()
        inter = gate_up.shape[1] // 2
        act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        a2 = _fake_quantized(act, w2.block) if isinstance(w2, Fp8Stack) else act.float()
        y = a2 @ g2.t()
        out.index_add_(0, tokens, y * topk_weights.reshape(-1)[rows, None].float())
    return out.to(x.dtype)
