"""Attention metadata for one forward pass, set by the ModelRunner and read by every
attention layer (one object per step, like nano-vllm's context)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is stored (-1: skip)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32, new tokens per sequence
    seq_lens: torch.Tensor  # [B] int32, context length including the new tokens
    max_seqlen_q: int
    max_seqlen_k: int
    decode_only: bool  # every sequence has exactly one new token
    no_history: bool  # no sequence has cached tokens (pure prefill)


_current: AttentionMetadata | None = None


def set_attention_metadata(meta: AttentionMetadata | None) -> None:
    global _current
    _current = meta


def get_attention_metadata() -> AttentionMetadata:
    assert _current is not None, "attention called outside a ModelRunner step"
    return _current
