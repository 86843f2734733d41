"""4-bit weight-only checkpoints (AWQ, GPTQ): their packed tensors unpacked into the weight they mean.

A linear layer's weight W [out, in] is stored as 4-bit integers q with, per group of `group_size`
input rows, a scale s and a zero point z: W^T[i, j] = (q[i, j] - z[g(i), j]) * s[g(i), j].

- AWQ (`version: "gemm"`): `qweight` int32 [in, out / 8], eight output columns to an int32 in the
  order 0, 2, 4, 6, 1, 3, 5, 7 (nibble k holds column AWQ_ORDER[k]); `qzeros` int32 [in / g, out / 8]
  packed the same way; `scales` [in / g, out]; g(i) = i // group_size.
- GPTQ: `qweight` int32 [in / 8, out], eight input rows to an int32, row i at bits 4 (i % 8);
  `qzeros` int32 [groups, out / 8], column j at bits 4 (j % 8), stored minus one in the original
  format (`checkpoint_format: "gptq"`: z + 1; "gptq_v2": z); `scales` [groups, out]; `g_idx` [in]
  gives each input row's group (with `desc_act` it is a permutation's order, not i // group_size).

`unpack_checkpoint` reads a layer's tensors into plain integers (q, z, s, g_idx); model/int4_layer.py
packs them into the 4-bit kernel's layout (ops/int4_linear.py). `dequantize_awq` / `dequantize_gptq`
give the weight they mean, W [out, in] in float32: for the layers that stay dequantized at load (a
mixture of experts' experts, and the other cases model/quantization.py lists).
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an AWQ int32 holds output column AWQ_ORDER[k]
PARTS = ("qweight", "qzeros", "scales", "g_idx")  # the checkpoint tensors of one quantized layer


def _nibbles(x: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> [..., n, 8]: nibble k of each int32 (bits 4k .. 4k + 3), 0..15."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=x.device)
    return (x.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [rows, cols / 8] -> int32 [rows, cols] in column order."""
    nib = _nibbles(packed)  # [rows, cols/8, 8], nibble k = column AWQ_ORDER[k] of its eight
    cols = torch.empty_like(nib)
    cols[..., list(AWQ_ORDER)] = nib
    return cols.reshape(packed.shape[0], -1)


def unpack_gptq_rows(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight int32 [in / 8, out] -> int32 [in, out] (row i at bits 4 (i % 8))."""
    return _nibbles(packed).permute(0, 2, 1).reshape(-1, packed.shape[1])


def unpack_gptq_cols(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ qzeros int32 [groups, out / 8] -> int32 [groups, out] (column j at bits 4 (j % 8))."""
    return _nibbles(packed).reshape(packed.shape[0], -1)


def unpack_checkpoint(
    method: str, parts: dict[str, torch.Tensor], zero_offset: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q int32 [in, out] 0..15, zero points int32 [groups, out] (GPTQ's original format: 1..16),
    scales [groups, out], g_idx [in] or None) of a layer's AWQ or GPTQ tensors."""
    if method == "awq":
        return unpack_awq(parts["qweight"]), unpack_awq(parts["qzeros"]), parts["scales"], None
    z = unpack_gptq_cols(parts["qzeros"]) + zero_offset
    return unpack_gptq_rows(parts["qweight"]), z, parts["scales"], parts.get("g_idx")


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W [out, in] float32 of an AWQ layer."""
    q, z, s = unpack_awq(qweight), unpack_awq(qzeros), scales.float()
    group = q.shape[0] // s.shape[0]
    w = (q - z.repeat_interleave(group, dim=0)).float() * s.repeat_interleave(group, dim=0)
    return w.t().contiguous()


def dequantize_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None, zero_offset: int
) -> torch.Tensor:
    """W [out, in] float32 of a GPTQ layer; zero_offset 1 for the original format (zeros stored minus one)."""
    q = unpack_gptq_rows(qweight)
    z = unpack_gptq_cols(qzeros) + zero_offset
    s = scales.float()
    if g_idx is None:  # no g_idx: groups of consecutive rows
        g_idx = torch.arange(q.shape[0]) // (q.shape[0] // s.shape[0])
    g = g_idx.long()
    w = (q - z[g]).float() * s[g]
    return w.t().contiguous()
