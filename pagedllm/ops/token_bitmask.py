"""The allowed-token bitmask of structured output, applied to the logits on their device.

A constrained row r of the step has a packed bitmask of W = ceil(V / 32) int32 words: token j may
be drawn when bit j % 32 of word j // 32 is set (llguidance's and xgrammar's layout). Tokens the
mask forbids get -inf; ids at or past the mask's width (a model vocabulary padded past the
tokenizer's) are forbidden too. Only the constrained rows are touched, so a step without them
pays nothing (the caller does not call this).
"""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab] bool, True where the token is allowed."""
    r, w = bitmask.shape
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]: arithmetic shift, bit 31 still masked by & 1
    allowed = bits.reshape(r, w * 32).bool()
    if w * 32 >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(r, vocab - w * 32, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [B, V] (in place): rows [R] int64 of it keep only their allowed tokens' logits,
    the others become -inf. bitmask: [R, W] int32 on the logits' device. No host sync."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    sub = logits.index_select(0, rows)
    logits.index_copy_(0, rows, sub.masked_fill(~allowed, float("-inf")))
