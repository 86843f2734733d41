"""This rank's shard of a 4-bit linear weight (AWQ, GPTQ), kept packed in the kernel's layout
(ops/int4_linear.py: `qweight` int32 [K / 8, N], `scales` and uint8 `qzeros` [K / group, N], `perm`).

A checkpoint tensor (one layer, or one part of a packed qkv / gate_up layer) is unpacked into plain
integers (model/int4_weights.py), cut to this rank's input rows (row-parallel: whole groups only,
model/quantization.py) and output columns (column-parallel, and its part's columns of a packed
layer: the parts concatenate along N), its rows sorted by group (GPTQ's desc_act; identity otherwise),
and packed. Every part of a packed layer must share one input order (`perm`): the kernel reads x
once for all of its columns.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.ops.int4_linear import dequantize, int4_linear, pack_k

Part = tuple[int, int, int, int]  # (first column here, columns, columns in the checkpoint tensor, first taken)


def sorted_rows(
    name: str, g_idx: torch.Tensor | None, groups_total: int, k_first: int, k_here: int, k_total: int, group: int
) -> tuple[torch.Tensor | None, int]:
    """This shard's input rows [k_first, k_first + k_here) of a checkpoint tensor sorted by group (GPTQ's
    g_idx; None: consecutive groups): (int32 perm, None for the identity; the shard's first group).
    ValueError where a group of the shard does not hold `group` of its rows (the kernel's equal groups)."""
    if g_idx is None:
        g_idx = torch.arange(k_total) // (k_total // groups_total)
    g_here = g_idx[k_first : k_first + k_here].long().cpu()
    perm = torch.argsort(g_here, stable=True)
    first_group = int(g_here.min())
    if not torch.equal(g_here[perm], first_group + torch.arange(k_here) // group):
        raise ValueError(
            f"4-bit layer {name}: its g_idx does not put {group} input rows in each group of this shard; "
            "pagedllm's kernel takes groups of equal size (any order)"
        )
    identity = torch.equal(perm, torch.arange(k_here))
    return (None if identity else perm.to(torch.int32)), first_group


class Int4Weight(nn.Module):
    """W [N, K] of this rank as 4-bit integers with one scale and zero point per `group` rows of K."""

    perm: nn.Parameter | None  # int32 [K]: row k of W^T multiplies input column perm[k]; None: identity

    def __init__(self, n: int, k: int, group: int, scale_dtype: torch.dtype, device: torch.device):
        super().__init__()
        assert k % group == 0 and group % 8 == 0, (k, group)
        self.group = group
        self.qweight = nn.Parameter(torch.zeros(k // 8, n, dtype=torch.int32, device=device), requires_grad=False)
        self.scales = nn.Parameter(torch.zeros(k // group, n, dtype=scale_dtype, device=device), requires_grad=False)
        self.qzeros = nn.Parameter(torch.zeros(k // group, n, dtype=torch.uint8, device=device), requires_grad=False)
        self.register_parameter("perm", None)
        self.parts_loaded = 0  # checkpoint tensors loaded so far (the first one sets the input order)

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of this rank's W."""
        return self.qweight.shape[1], self.qweight.shape[0] * 8

    def load(
        self,
        name: str,
        unpacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
        parts: list[Part],
        cols: tuple[int, int, int],
    ) -> None:
        """One checkpoint tensor's (q [K_total, N_ckpt], zeros, scales [groups, N_ckpt], g_idx [K_total])
        into this rank's columns `parts` (linear.py: scale_rows) and its input rows cols = (rows here,
        first row, rows in the checkpoint)."""
        q, zeros, scales, g_idx = unpacked
        k_here, k_first, k_total = cols
        if q.shape[0] != k_total or q.shape[1] != sum(p[2] for p in parts) or k_total % scales.shape[0]:
            raise ValueError(
                f"4-bit layer {name}: q {tuple(q.shape)} and scales {tuple(scales.shape)} do not match its "
                f"{k_total} input rows x {sum(p[2] for p in parts)} outputs"
            )
        perm, first_group = sorted_rows(name, g_idx, scales.shape[0], k_first, k_here, k_total, self.group)
        self._set_order(name, perm)
        group_rows = slice(first_group, first_group + k_here // self.group)
        rows = slice(k_first, k_first + k_here)
        q_rows = q[rows] if perm is None else q[rows][perm.to(q.device).long()]
        start = 0
        for offset, size, ckpt_cols, first in parts:
            c = slice(start + first, start + first + size)
            self.qweight.data[:, offset : offset + size] = pack_k(q_rows[:, c]).to(self.qweight.device)
            self.scales.data[:, offset : offset + size] = scales[group_rows, c].to(self.scales.dtype)
            self.qzeros.data[:, offset : offset + size] = zeros[group_rows, c].to(torch.uint8)
            start += ckpt_cols
        self.parts_loaded += 1

    def _set_order(self, name: str, perm: torch.Tensor | None) -> None:
        if self.parts_loaded == 0:
            if perm is not None:
                self.perm = nn.Parameter(perm.to(self.qweight.device), requires_grad=False)
            return
        same = perm is None if self.perm is None else perm is not None and torch.equal(self.perm.cpu(), perm.cpu())
        if not same:
            raise ValueError(
                f"4-bit layer {name}: its packed parts' input orders (GPTQ desc_act g_idx) differ; pagedllm's "
                "kernel reads the input in one order per layer"
            )

    def weight(self) -> torch.Tensor:
        """W [N, K] in float32, in the input's column order (for tests and inspection)."""
        wt = dequantize(self.qweight, self.scales, self.qzeros, self.group)
        if self.perm is not None:
            wt = torch.empty_like(wt).index_copy_(0, self.perm.long(), wt)
        return wt.t()

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int4_linear(x, self.qweight, self.scales, self.qzeros, self.group, self.perm, bias)
