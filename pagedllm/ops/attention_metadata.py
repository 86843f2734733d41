"""Attention metadata: how one forward pass's packed tokens map onto sequences and KV slots.

The slot mapping and block tables are those of one KV-cache group; a model whose layers have
several attention kinds (sliding windows) gets one metadata per group in `groups`.
Built by the ModelRunner for each step (or over the CUDA graphs' static buffers) and passed
explicitly down the forward, model -> layer -> attention; nothing keeps it between calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is stored (PAD_SLOT_ID: skip)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32, new tokens per sequence
    seq_lens: torch.Tensor  # [B] int32, context length including the new tokens
    max_seqlen_q: int
    max_seqlen_k: int
    decode_only: bool  # every sequence has exactly one new token
    no_history: bool  # no sequence has cached tokens (pure prefill)
    # decode only: [B] int32, the batch longest first (`longest_first`), the order in
    # which decode attention launches the sequences' programs; the time changes, not the result.
    # None: batch order (and every path that is not decode).
    seq_order: torch.Tensor | None = None
    # one entry per KV-cache group (engine/kv_cache_groups.py) when the model has more than one:
    # the same step with that group's slot_mapping and block_tables. Empty: one group, this one.
    groups: tuple[AttentionMetadata, ...] = field(default=())

    def group(self, g: int) -> AttentionMetadata:
        """The metadata a layer of KV-cache group g attends with."""
        return self.groups[g] if self.groups else self

    def add_groups(self, tables: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> AttentionMetadata:
        """Give this metadata (the first group's) the other groups' (slot_mapping, block_tables)."""
        others = [replace(self, slot_mapping=s, block_tables=b) for s, b in tables]
        if others:
            self.groups = (self, *others)
        return self


def longest_first(seq_lens: np.ndarray) -> np.ndarray:
    """The launch order of a decode batch: its indices by context length, longest first (ties in
    batch order), int32. Decode attention's programs run one sequence's keys each; with lengths
    mixed, a long sequence launched last finishes alone while the SMs idle (largest job first:
    H200, fp8 KV, 240 sequences of 128-1,536 keys: 171 -> 127 us a layer,
    benchmarks/results/decode-attention/)."""
    return np.argsort(-seq_lens.astype(np.int64), kind="stable").astype(np.int32)
