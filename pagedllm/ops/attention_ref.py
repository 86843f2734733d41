"""Torch references for the paged KV store and paged attention.

They are exact (float32 math) and device-agnostic: the CPU path runs on them and the
Triton kernels are tested against them. `paged_attention_ref` is the plain oracle (one
sequence at a time); the CPU path uses the `*_grouped` forms, which give the same results
without a Python loop over decode rows and without padding a sequence to another's length.

An fp8 cache (ops/kv_quant.py) is stored through `quantize_ref` and read back dequantized in
float32 (`stored * k_scale`, `stored * v_scale`); for a cache in the model's dtype the scales
are ignored.
"""

from __future__ import annotations

import torch

from pagedllm.ops.kv_quant import dequantize_ref, quantize_ref


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value: [N, Hkv, D]; caches: [num_blocks, Hkv, block_size, D]; a PAD_SLOT_ID (negative) slot is skipped.
    An fp8 cache stores saturate(key / k_scale) and saturate(value / v_scale)."""
    block_size = k_cache.shape[2]
    keep = slot_mapping >= 0  # not PAD_SLOT_ID
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, :, offsets] = quantize_ref(key[keep], k_scale, k_cache.dtype)
    v_cache[blocks, :, offsets] = quantize_ref(value[keep], v_scale, v_cache.dtype)


def as_stored(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as attention reads it back from a cache of cache_dtype (x itself unless the cache is fp8),
    in x's dtype: what the pure-prefill path attends over, so that it sees what a later step
    reading the cache sees."""
    if cache_dtype == x.dtype:
        return x
    return dequantize_ref(quantize_ref(x, scale, cache_dtype), scale).to(x.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: float = 1.0) -> torch.Tensor:
    """The first seq_len tokens of one sequence's K or V, dequantized to float32: [seq_len, Hkv, D]."""
    block_size = cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    tiles = dequantize_ref(cache[block_table[:num_blocks].long()], scale)  # [nb, Hkv, bs, D]
    return tiles.transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])[:seq_len]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Varlen causal attention over the paged cache.

    q: [T, Hq, D], the new tokens of B sequences packed; cu_seqlens_q: [B+1].
    seq_lens: [B], each sequence's context length *including* its new tokens, whose K/V
    must already be stored. Query i of a sequence with q_len L sits at position
    seq_len - L + i and attends to positions <= that one. Returns [T, Hq, D] in q's dtype.
    """
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end > start:
            out[start:end] = _attend_one(
                q[start:end], k_cache, v_cache, block_tables[b], seq_len, scale, k_scale, v_scale
            )
    return out


def _attend_one(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One sequence's L new tokens q [L, Hq, D] over its seq_len positions, causal: [L, Hq, D]."""
    q_len, group = q.shape[0], q.shape[1] // k_cache.shape[1]
    k = gather_kv(k_cache, block_table, seq_len, k_scale)
    v = gather_kv(v_cache, block_table, seq_len, v_scale)
    qs = q.float().transpose(0, 1)  # [Hq, L, D]
    k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
    v = v.transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.matmul(qs, k.transpose(1, 2)) * scale  # [Hq, L, S]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    k_pos = torch.arange(seq_len, device=q.device)
    scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(0, 1).to(q.dtype)


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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Decode only (one query per sequence), all sequences in one batched computation.

    Same result as paged_attention_ref with q_len 1, without its per-sequence loop: K/V are
    gathered in block layout [B, nb, Hkv, bs, D] and positions past seq_len are masked. Every
    row is padded to max_seqlen_k, so work and memory are B x max_seqlen_k: meant for rows of
    similar length, which is how `paged_decode_attention_grouped` calls it.
    """
    b, hq, d = q.shape
    hkv, bs = k_cache.shape[1], k_cache.shape[2]
    group, nb = hq // hkv, -(-max_seqlen_k // bs)
    flat = block_tables[:, :nb].reshape(-1).long()  # index_select: ~3x faster than k_cache[table] on CPU
    k = dequantize_ref(k_cache.index_select(0, flat).view(b, nb, hkv, bs, d), k_scale)  # [B, nb, Hkv, bs, D]
    v = dequantize_ref(v_cache.index_select(0, flat).view(b, nb, hkv, bs, d), v_scale)
    scores = torch.matmul(q.float().view(b, 1, hkv, group, d), k.transpose(-1, -2)) * scale  # [B, nb, Hkv, G, bs]
    pos = torch.arange(nb * bs, device=q.device).view(1, nb, 1, 1, bs)
    scores.masked_fill_(pos >= seq_lens.long().view(b, 1, 1, 1, 1), float("-inf"))
    probs = torch.softmax(scores.permute(0, 2, 3, 1, 4).reshape(b, hkv, group, nb * bs), dim=-1)
    probs = probs.view(b, hkv, group, nb, bs).permute(0, 3, 1, 2, 4)  # [B, nb, Hkv, G, bs]
    return torch.matmul(probs, v).sum(1).reshape(b, hq, d).to(q.dtype)


PAD_BUDGET = 1 << 18
"""K and V elements of padding that one group of decode rows may carry (1 MiB in float32),
against the fixed cost of one more group (~0.2-0.3 ms on CPU). `benchmarks/cpu_attention.py
--budget-sweep` times 2^16..2^20 on batches of similar, two and spread lengths: within that
range no choice wins everywhere and the differences are near the shared machine's noise, while
one padded call for the whole batch is up to 2-30x slower (benchmarks/results/cpu-attention.json)."""


def decode_groups(seq_lens: list[int], block_size: int, budget_blocks: int) -> list[list[int]]:
    """Rows of a decode batch in groups of similar length; rows with no context are left out.

    A group is padded to its longest row, so its padding is the sum over its rows of
    (longest - own) blocks. Longest rows first, a row joins the current group while that sum
    stays within budget_blocks, else it starts the next group. A batch whose whole padding fits
    is one group in batch order.
    """
    nb = [-(-n // block_size) for n in seq_lens]
    if nb and min(nb) > 0 and len(nb) * max(nb) - sum(nb) <= budget_blocks:
        return [list(range(len(nb)))]
    groups: list[list[int]] = []
    top = waste = 0
    for i in sorted((i for i, n in enumerate(nb) if n > 0), key=lambda i: -nb[i]):
        if groups and waste + top - nb[i] <= budget_blocks:
            groups[-1].append(i)
            waste += top - nb[i]
        else:
            groups.append([i])
            top, waste = nb[i], 0
    return groups


def paged_decode_attention_grouped(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    pad_budget: int = PAD_BUDGET,
) -> torch.Tensor:
    """Decode (one query per sequence) without padding every sequence to the batch's longest.

    The rows are split by `decode_groups` and each group runs `paged_decode_attention_ref`
    padded to its own longest row, so work and memory follow the context each sequence has
    (plus at most pad_budget K/V elements of padding per group), not batch x longest context.
    Padded positions are read and given probability exactly 0, so every block a table names
    must hold finite values (the KV tensor starts zeroed); they add exact zeros, and a row gets
    the same bits when a long sequence joins its step (tests/ops/test_attention_ref.py).
    Rows with seq_len 0 get zeros, as in `paged_attention_ref`.
    """
    hkv, bs, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    lens = seq_lens.tolist()
    groups = decode_groups(lens, bs, max(1, pad_budget // (2 * hkv * bs * d)))
    if len(groups) == 1 and len(groups[0]) == len(lens):  # the common case: no copies in or out
        return paged_decode_attention_ref(
            q, k_cache, v_cache, block_tables, seq_lens, max(lens), scale, k_scale, v_scale
        )
    out = torch.zeros_like(q)
    for rows in groups:
        idx = torch.tensor(rows, device=q.device)
        part = paged_decode_attention_ref(
            q.index_select(0, idx),
            k_cache,
            v_cache,
            block_tables.index_select(0, idx),
            seq_lens.index_select(0, idx),
            lens[rows[0]],  # the longest: groups are ordered longest first
            scale,
            k_scale,
            v_scale,
        )
        out.index_copy_(0, idx, part)
    return out


def paged_attention_grouped(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """`paged_attention_ref`'s contract, with the decode rows (one new token) of a mixed batch
    batched by `paged_decode_attention_grouped`; longer rows run one at a time, as there."""
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    out = torch.empty_like(q)
    decode = [b for b in range(len(lens)) if cu[b + 1] - cu[b] == 1]
    if decode:
        rows = torch.tensor(decode, device=q.device)
        tokens = torch.tensor([cu[b] for b in decode], device=q.device)
        part = paged_decode_attention_grouped(
            q.index_select(0, tokens),
            k_cache,
            v_cache,
            block_tables.index_select(0, rows),
            seq_lens.index_select(0, rows),
            scale,
            k_scale,
            v_scale,
        )
        out.index_copy_(0, tokens, part)
    for b, seq_len in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        if end - start > 1:
            out[start:end] = _attend_one(
                q[start:end], k_cache, v_cache, block_tables[b], seq_len, scale, k_scale, v_scale
            )
    return out
