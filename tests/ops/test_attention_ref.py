"""The batched decode reference equals the general (looped) reference, and the CPU path
(TorchKernels.attend) equals both without padding any sequence to another's length."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pagedllm.ops import PAD_SLOT_ID
from pagedllm.ops.attention_metadata import AttentionMetadata
from pagedllm.ops.attention_ref import PAD_BUDGET, paged_attention_ref, paged_decode_attention_ref
from pagedllm.ops.kernels import TorchKernels


@pytest.mark.parametrize("block_size,group", [(4, 1), (8, 2), (16, 4)])
def test_batched_decode_reference_matches_looped(block_size, group):
    torch.manual_seed(0)
    hkv, d, num_blocks = 2, 16, 128
    seq_lens = torch.tensor([1, 7, 33, 20, 64], dtype=torch.int32)
    b = len(seq_lens)
    k_cache = torch.randn(num_blocks, hkv, block_size, d)
    v_cache = torch.randn(num_blocks, hkv, block_size, d)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    tables = torch.randperm(num_blocks)[: b * max_blocks].view(b, max_blocks).int()
    q = torch.randn(b, hkv * group, d)
    cu = torch.arange(b + 1, dtype=torch.int32)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, cu, seq_lens, 0.25)
    got = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, int(seq_lens.max()), 0.25)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # a wrong length must show: the mask matters
    shorter = (seq_lens - 1).clamp(min=1)
    wrong = paged_decode_attention_ref(q, k_cache, v_cache, tables, shorter, int(seq_lens.max()), 0.25)
    assert not torch.allclose(wrong, ref, atol=1e-4)


# ---- the CPU path (TorchKernels.attend) never pads a sequence to another's length -----------


def _step(q_lens, seq_lens, hq, hkv, d, block_size, seed=0):
    """One step's (q, k_cache, v_cache, AttentionMetadata); every position's K/V is stored."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 3
    k_cache = torch.randn(num_blocks, hkv, block_size, d, generator=g)
    v_cache = torch.randn(num_blocks, hkv, block_size, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)  # a padding column too
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[used : used + n]
        used += n
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    total = int(cu[-1])
    meta = AttentionMetadata(
        slot_mapping=torch.full((total,), PAD_SLOT_ID, dtype=torch.int64),
        block_tables=tables,
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seq_lens),
        decode_only=all(n == 1 for n in q_lens),
        no_history=False,
    )
    return torch.randn(total, hq, d, generator=g), k_cache, v_cache, meta


def _attend(q, k_cache, v_cache, meta):
    return TorchKernels().attend(q, q, q, k_cache, v_cache, meta, 0.125)


def _looped(q, k_cache, v_cache, meta):
    return paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, 0.125)


def _subset(q, k_cache, v_cache, meta, rows):
    """The same step restricted to some of its sequences (same cache, same tables)."""
    cu = meta.cu_seqlens_q.tolist()
    idx = torch.tensor(rows)
    tokens = torch.cat([torch.arange(cu[b], cu[b + 1]) for b in rows])
    q_lens = [cu[b + 1] - cu[b] for b in rows]
    sub_cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    sub_cu[1:] = torch.tensor(q_lens).cumsum(0)
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[tokens],
        block_tables=meta.block_tables[idx],
        cu_seqlens_q=sub_cu,
        seq_lens=meta.seq_lens[idx],
        max_seqlen_q=max(q_lens),
        max_seqlen_k=int(meta.seq_lens[idx].max()),
        decode_only=all(n == 1 for n in q_lens),
        no_history=False,
    )
    return q[tokens], k_cache, v_cache, sub


def _flops(step) -> int:
    with FlopCounterMode(display=False) as counter:
        _attend(*step)
    return counter.get_total_flops()


SHORT = [48 + (7 * i) % 33 for i in range(12)]  # contexts 48..80, as 12 short decode streams


def _long_context(hkv, d, block_size=16):
    """A context whose padding of even one short row to it is past PAD_BUDGET, so that no
    grouping may pad the short rows to it (1,280 tokens at the default model's heads)."""
    return block_size * (PAD_BUDGET // (2 * hkv * block_size * d) + 16)


@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 64), (16, 8, 128)])  # default model, Qwen3-0.6B heads
def test_decode_work_of_a_long_sequence_does_not_pad_the_short_ones(hq, hkv, d):
    """A long decode stream beside short ones adds its own work only (flops counted, not timed):
    padding the short rows to its context made the mixed step cost ~batch x longest."""
    mixed = _step([1] * (len(SHORT) + 1), SHORT + [_long_context(hkv, d)], hq, hkv, d, 16)
    short = _subset(*mixed, list(range(len(SHORT))))
    long = _subset(*mixed, [len(SHORT)])
    assert _flops(mixed) <= _flops(short) + _flops(long)
    # and each row's result does not depend on the company: same bits with or without the long one
    out = _attend(*mixed)
    assert torch.equal(out[: len(SHORT)], _attend(*short))
    assert torch.equal(out[len(SHORT) :], _attend(*long))
    torch.testing.assert_close(out, _looped(*mixed), rtol=1e-5, atol=1e-5)


def test_decode_rows_of_a_mixed_step_are_batched_like_a_decode_step():
    """Decode rows beside a prefill chunk with a long cached prefix: no per-row work beyond their
    own context, and the same bits as in a decode-only step of the same rows."""
    q_lens = [1] * len(SHORT) + [64]
    mixed = _step(q_lens, SHORT + [_long_context(2, 64)], 6, 2, 64, 16)
    decode = _subset(*mixed, list(range(len(SHORT))))
    chunk = _subset(*mixed, [len(SHORT)])
    assert _flops(mixed) <= _flops(decode) + _flops(chunk)
    out = _attend(*mixed)
    assert torch.equal(out[: len(SHORT)], _attend(*decode))
    torch.testing.assert_close(out, _looped(*mixed), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size,group", [(1, 1), (3, 2), (8, 4), (16, 2), (32, 1)])
@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [
        ([1, 1, 1, 1, 1], [1, 5, 300, 17, 2]),  # decode, one-token contexts, a long row
        ([1, 1, 1], [700, 1, 40]),
        ([1, 9, 1, 0, 23, 4, 1], [13, 71, 600, 9, 23, 36, 1]),  # prefill with a cached prefix, q_len 0
        ([5, 1], [5, 1]),  # a prefill row without history beside a decode
    ],
)
def test_cpu_attention_matches_looped_reference(block_size, group, q_lens, seq_lens):
    """GQA, any block size, causal prefill over a cached prefix, empty and one-token sequences."""
    hkv, d = 2, 64
    step = _step(q_lens, seq_lens, hkv * group, hkv, d, block_size, seed=block_size * 10 + group)
    torch.testing.assert_close(_attend(*step), _looped(*step), rtol=1e-5, atol=1e-5)


def test_decode_row_without_context_is_zero_like_the_looped_reference():
    q, k_cache, v_cache, meta = _step([1, 1, 1], [1, 900, 30], 4, 2, 64, 16)
    meta.seq_lens[0] = 0
    out = _attend(q, k_cache, v_cache, meta)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out, _looped(q, k_cache, v_cache, meta), rtol=1e-5, atol=1e-5)
