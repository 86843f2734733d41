"""Torch references for the paged KV store and paged attention.

They are exact (float32 math) and device-agnostic: the CPU path runs on them and the
Triton kernels are tested against them.
"""

from __future__ import annotations

import torch


def store_kvcache_ref(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value: [N, Hkv, D]; caches: [num_blocks, Hkv, block_size, D]; a PAD_SLOT_ID (negative) slot is skipped."""
    block_size = k_cache.shape[2]
    keep = slot_mapping >= 0  # not PAD_SLOT_ID
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, :, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, :, offsets] = value[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence's K or V: [seq_len, Hkv, D]."""
    block_size = cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    tiles = cache[block_table[:num_blocks].long()]  # [nb, Hkv, bs, D]
    return tiles.transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])[:seq_len]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Varlen causal attention over the paged cache.

    q: [T, Hq, D], the new tokens of B sequences packed; cu_seqlens_q: [B+1].
    seq_lens: [B], each sequence's context length *including* its new tokens, whose K/V
    must already be stored. Query i of a sequence with q_len L sits at position
    seq_len - L + i and attends to positions <= that one. Returns [T, Hq, D] in q's dtype.
    """
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[1]
    group = hq // hkv
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], seq_len).float()
        v = gather_kv(v_cache, block_tables[b], seq_len).float()
        qs = q[start:end].float().transpose(0, 1)  # [Hq, L, D]
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        scores = torch.matmul(qs, k.transpose(1, 2)) * scale  # [Hq, L, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
    return out


def prefill_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of new tokens over themselves only (no cached history): [T, Hq, D]."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    cu = cu_seqlens_q.tolist()
    for start, end in zip(cu[:-1], cu[1:], strict=False):
        if end == start:
            continue
        qs = q[start:end].transpose(0, 1)
        ks = k[start:end].transpose(0, 1).repeat_interleave(group, dim=0)
        vs = v[start:end].transpose(0, 1).repeat_interleave(group, dim=0)
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_k: int,
    scale: float,
) -> torch.Tensor:
    """Decode only (one query per sequence), all sequences in one batched computation.

    Same result as paged_attention_ref with q_len 1, without its per-sequence loop: K/V are
    gathered in block layout [B, nb, Hkv, bs, D] and positions past seq_len are masked.
    """
    b, hq, d = q.shape
    hkv, bs = k_cache.shape[1], k_cache.shape[2]
    group, nb = hq // hkv, -(-max_seqlen_k // bs)
    flat = block_tables[:, :nb].reshape(-1).long()  # index_select: ~3x faster than k_cache[table] on CPU
    k = k_cache.index_select(0, flat).view(b, nb, hkv, bs, d).float()  # [B, nb, Hkv, bs, D]
    v = v_cache.index_select(0, flat).view(b, nb, hkv, bs, d).float()
    scores = torch.matmul(q.float().view(b, 1, hkv, group, d), k.transpose(-1, -2)) * scale  # [B, nb, Hkv, G, bs]
    pos = torch.arange(nb * bs, device=q.device).view(1, nb, 1, 1, bs)
    scores.masked_fill_(pos >= seq_lens.long().view(b, 1, 1, 1, 1), float("-inf"))
    probs = torch.softmax(scores.permute(0, 2, 3, 1, 4).reshape(b, hkv, group, nb * bs), dim=-1)
    probs = probs.view(b, hkv, group, nb, bs).permute(0, 3, 1, 2, 4)  # [B, nb, Hkv, G, bs]
    return torch.matmul(probs, v).sum(1).reshape(b, hq, d).to(q.dtype)
