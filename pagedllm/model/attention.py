"""Paged attention layer: store the new K/V through slot_mapping, then attend over the
block tables. The backend is the torch reference on CPU and the Triton kernels on GPU."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.context import get_attention_metadata
from pagedllm.ops.attention_ref import (
    paged_attention_ref,
    paged_decode_attention_ref,
    prefill_attention_ref,
    store_kvcache_ref,
)


class TorchBackend:
    """Exact reference: used on CPU, and the oracle for the kernels."""

    @staticmethod
    def store(k, v, k_cache, v_cache, slot_mapping):
        store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)

    @staticmethod
    def attend(q, k, v, k_cache, v_cache, meta, scale):
        if meta.no_history or not k_cache.numel():  # pure prefill: attend over the new tokens directly
            return prefill_attention_ref(q, k, v, meta.cu_seqlens_q, scale)
        if meta.decode_only:  # batched, no per-sequence loop
            return paged_decode_attention_ref(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.max_seqlen_k, scale
            )
        return paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, scale)


class TritonBackend:
    @staticmethod
    def store(k, v, k_cache, v_cache, slot_mapping):
        from pagedllm.ops.store_kv import store_kvcache

        store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    @staticmethod
    def attend(q, k, v, k_cache, v_cache, meta, scale):
        if not k_cache.numel():  # the profiling run, before the KV tensor exists
            return prefill_attention_ref(q, k, v, meta.cu_seqlens_q, scale)
        from pagedllm.ops.paged_attention import paged_attention

        return paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seq_lens,
            scale,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
        )


class Attention(nn.Module):
    backend = TorchBackend  # the runner sets TritonBackend on GPU, per layer

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = self.v_cache = torch.tensor([])  # bound to views of the KV tensor by the runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]."""
        meta = get_attention_metadata()
        if self.k_cache.numel():
            self.backend.store(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.backend.attend(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
