"""Triton paged attention and KV store against the torch references.

Cases mix decode (q_len 1) and prefill with a cached prefix in one ragged batch, over
shuffled block tables; every cache slot no sequence owns holds NaN, so a kernel that reads
past a sequence's length (or through a padding block-table entry) fails loudly.
"""

import math

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from pagedllm.ops import PAD_SLOT_ID  # noqa: E402
from pagedllm.ops.attention_metadata import longest_first  # noqa: E402
from pagedllm.ops.attention_ref import (  # noqa: E402
    gather_kv,
    paged_attention_ref,
    store_kvcache_ref,
)
from pagedllm.ops.paged_attention import (  # noqa: E402
    TILES,
    _pick_config,
    default_num_splits,
    paged_attention,
    paged_attention_decode,
)
from pagedllm.ops.store_kv import store_kvcache  # noqa: E402

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
}


def make_case(
    q_lens,
    hist,
    hq,
    hkv,
    d,
    bs,
    dtype,
    device,
    seed=0,
    spare_blocks=5,
    store_with_kernel=False,
    kv_dtype=None,
    k_scale=1.0,
    v_scale=1.0,
):
    """Random ragged batch. Returns dict of tensors for paged_attention(_ref). The caches are in
    kv_dtype (default: dtype), an fp8 one stored with k_scale / v_scale (ops/kv_quant.py)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + h for q, h in zip(q_lens, hist, strict=False)]
    nb = [math.ceil(s / bs) for s in seq_lens]
    num_blocks = sum(nb) + spare_blocks
    max_nb = max(nb) + 2  # padding columns in the table
    perm = torch.randperm(num_blocks, generator=g)
    bt = torch.zeros(len(q_lens), max_nb, dtype=torch.int32)
    k_cache = torch.full((num_blocks, hkv, bs, d), float("nan"), dtype=kv_dtype or dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    used = 0
    for b, n in enumerate(nb):
        bt[b, :n] = perm[used : used + n].int()
        used += n
    # K/V of every token of every sequence, and the slot it lives in.
    slots, ks, vs = [], [], []
    for b, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots.append(bt[b, pos // bs].long() * bs + pos % bs)
        ks.append(torch.randn(s, hkv, d, generator=g).to(dtype))
        vs.append(torch.randn(s, hkv, d, generator=g).to(dtype))
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    all_k, all_v = torch.cat(ks).to(device), torch.cat(vs).to(device)
    all_slots = torch.cat(slots).to(device)
    store = store_kvcache if store_with_kernel else store_kvcache_ref
    store(all_k, all_v, k_cache, v_cache, all_slots, k_scale, v_scale)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(dtype)
    return dict(
        q=q.to(device),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=bt.to(device),
        cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        scale=d**-0.5,
    )


def check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


# block size, head dim pairs: every block size meets more than one head dim across the grid
SHAPES = [(8, 64), (16, 32), (32, 128), (16, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("bs,d", SHAPES[:3])
def test_mixed_batch(bs, d, group, dtype, device):
    """Decode and prefill-with-history sequences in one batch."""
    hkv = 2
    q_lens = [1, 9, 1, 23, 4]
    hist = [13, 62, 40, 0, 2 * bs]  # prefix ends on a block boundary too
    c = make_case(q_lens, hist, hkv * group, hkv, d, bs, dtype, device, seed=bs + group)
    ref = paged_attention_ref(**c)
    out = paged_attention(**c, max_seqlen_q=max(q_lens))
    check(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,hkv", [(1, 3), (2, 2), (4, 1), (3, 2), (8, 1)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode(group, hkv, num_splits, dtype, device):
    bs, d = (16, 64) if group % 2 else (8, 32)
    seq = [1, 17, 64, 45, 130]
    c = make_case(
        [1] * len(seq), [s - 1 for s in seq], hkv * group, hkv, d, bs, dtype, device, seed=group * 10 + num_splits
    )
    ref = paged_attention_ref(**c)
    c.pop("cu_seqlens_q")
    out = paged_attention_decode(**c, num_splits=num_splits)
    check(out, ref, dtype)


@pytest.mark.parametrize("group,block_q,block_n", [(1, 16, 16), (2, 8, 32), (4, 4, 16)])
def test_small_tiles(group, block_q, block_n, device):
    """Tiles much smaller than the sequences: many q blocks per sequence, and histories
    that put the diagonal right at tile edges (ctx + 1 and ctx + 2 multiples of BLOCK_N)."""
    bq = max(block_q, 16 // group)  # tl.dot needs M = BLOCK_Q * group >= 16
    q_lens = [1, 37, 2 * bq + 1, 5, 3]
    hist = [2 * block_n - 1, block_n - 1, block_n - 2, 3 * block_n, block_n + 1]
    c = make_case(q_lens, hist, 2 * group, 2, 32, 8, torch.float32, device, seed=block_q)
    ref = paged_attention_ref(**c)
    for splits in (1, 3) if group == 1 else (1,):  # split-K: here once, and test_split_k_varlen
        out = paged_attention(
            **c, max_seqlen_q=max(q_lens), num_splits=splits, _config=dict(BLOCK_Q=bq, BLOCK_N=block_n)
        )
        check(out, ref, torch.float32)


@pytest.mark.parametrize("num_splits", [2, 7])  # even, and odd with splits that see only masked keys
@pytest.mark.parametrize("bs,d", [(8, 32), (32, 64)])
def test_split_k_varlen(num_splits, bs, d, device):
    """Split-K also holds for prefill rows (some splits see only masked keys)."""
    q_lens, hist = [1, 37, 5, 2], [90, 3, 0, 61]
    c = make_case(q_lens, hist, 4, 2, d, bs, torch.float32, device, seed=num_splits)
    ref = paged_attention_ref(**c)
    out = paged_attention(**c, max_seqlen_q=max(q_lens), num_splits=num_splits)
    check(out, ref, torch.float32)


def test_empty_sequence_and_loose_max_seqlen_q(device):
    """A q_len 0 sequence in the batch, and max_seqlen_q above the true maximum."""
    q_lens, hist = [3, 0, 1, 6], [5, 9, 20, 0]
    c = make_case(q_lens, hist, 4, 2, 32, 16, torch.float32, device)
    ref = paged_attention_ref(**c)
    out = paged_attention(**c, max_seqlen_q=50)
    check(out, ref, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_in_launch_order(num_splits, dtype, device):
    """Launched longest first (with a padding row, as in a CUDA graph), every sequence's output is
    bit-identical to the batch-order launch: the order moves programs, not their arithmetic."""
    seq = [5, 130, 17, 64, 1, 99]
    c = make_case([1] * len(seq), [s - 1 for s in seq], 4, 2, 32, 8, dtype, device, seed=num_splits)
    ref = paged_attention_ref(**c)
    c.pop("cu_seqlens_q")
    c["q"] = torch.cat([c["q"], torch.randn(1, 4, 32, device=device).to(dtype)])
    c["seq_lens"] = torch.cat([c["seq_lens"], torch.zeros(1, dtype=torch.int32, device=device)])
    c["block_tables"] = torch.cat([c["block_tables"], torch.zeros_like(c["block_tables"][:1])])
    order = longest_first(c["seq_lens"].cpu().numpy())
    assert order.tolist() == [1, 5, 3, 2, 0, 4, 6]
    plain = paged_attention_decode(**c, num_splits=num_splits)
    ordered = paged_attention_decode(**c, num_splits=num_splits, seq_order=torch.from_numpy(order).to(device))
    assert torch.equal(ordered, plain)
    check(ordered[:-1], ref, dtype)
    assert torch.equal(ordered[-1], torch.zeros_like(ordered[-1]))


def test_launch_order_is_read(device):
    """Program z computes sequence seq_order[z]: an order that names sequence 2 for every program
    writes row 2 only (so an order the kernel ignored could not pass the test above by accident)."""
    seq = [9, 40, 23]
    c = make_case([1] * 3, [s - 1 for s in seq], 4, 2, 32, 8, torch.float32, device)
    ref = paged_attention_ref(**c)
    c.pop("cu_seqlens_q")
    out = torch.full_like(c["q"], float("nan"))
    order = torch.full((3,), 2, dtype=torch.int32, device=device)
    paged_attention_decode(**c, num_splits=1, out=out, seq_order=order)
    check(out[2:], ref[2:], torch.float32)
    assert torch.isnan(out[:2]).all()


def test_longest_first():
    assert longest_first(np.array([3, 7, 7, 0, 12], dtype=np.int32)).tolist() == [4, 1, 2, 0, 3]
    assert longest_first(np.array([], dtype=np.int32)).dtype == np.int32


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_padding_rows_are_zero(num_splits, device):
    """CUDA-graph padding: seq_len 0 rows come out as zeros, not NaN; the rest unchanged."""
    c = make_case([1, 1], [20, 6], 4, 2, 32, 8, torch.float32, device)
    ref = paged_attention_ref(**c)
    q = torch.cat([c["q"], torch.randn(2, 4, 32, device=device)])
    seq_lens = torch.cat([c["seq_lens"], torch.zeros(2, dtype=torch.int32, device=device)])
    bt = torch.cat([c["block_tables"], torch.zeros_like(c["block_tables"][:2])])
    out = paged_attention_decode(q, c["k_cache"], c["v_cache"], bt, seq_lens, c["scale"], num_splits=num_splits)
    check(out[:2], ref, torch.float32)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))


def test_strided_q_and_out(device):
    """q a strided view of a fused qkv projection; out written into a given buffer."""
    q_lens, hist = [1, 7, 2], [30, 10, 0]
    hq, hkv, d = 4, 2, 32
    c = make_case(q_lens, hist, hq, hkv, d, 16, torch.float32, device)
    t = c["q"].shape[0]
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=device)
    qkv[:, : hq * d] = c["q"].reshape(t, -1)
    c["q"] = qkv[:, : hq * d].view(t, hq, d)
    assert not c["q"].is_contiguous()
    ref = paged_attention_ref(**c)
    buf = torch.full((t, hq, d), float("nan"), device=device)
    out = paged_attention(**c, max_seqlen_q=max(q_lens), out=buf)
    assert out.data_ptr() == buf.data_ptr()
    check(out, ref, torch.float32)


def test_store_then_attend(device):
    """KV written by the Triton store kernel is what attention reads."""
    q_lens, hist = [1, 12, 1], [33, 4, 9]
    c = make_case(q_lens, hist, 8, 2, 64, 8, torch.bfloat16, device, store_with_kernel=True)
    c_ref = make_case(q_lens, hist, 8, 2, 64, 8, torch.bfloat16, device)
    assert torch.equal(c["k_cache"].nan_to_num(7.0), c_ref["k_cache"].nan_to_num(7.0))
    ref = paged_attention_ref(**c_ref)
    out = paged_attention(**c, max_seqlen_q=max(q_lens))
    check(out, ref, torch.bfloat16)


def test_cases_are_causal_sensitive(device):
    """The cases would catch a kernel that ignored the causal mask: attending to the whole
    context gives a clearly different answer from the causal one."""
    q_lens, hist = [9, 4], [13, 0]
    c = make_case(q_lens, hist, 4, 2, 32, 8, torch.float32, device)
    ref = paged_attention_ref(**c)
    q0 = c["q"][:9].float().transpose(0, 1)
    k = gather_kv(c["k_cache"], c["block_tables"][0], 22).float().transpose(0, 1)
    v = gather_kv(c["v_cache"], c["block_tables"][0], 22).float().transpose(0, 1)
    k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
    no_mask = (torch.softmax(q0 @ k.transpose(1, 2) * c["scale"], -1) @ v).transpose(0, 1)
    assert (no_mask - ref[:9]).abs().max() > 0.1
    out = paged_attention(**c, max_seqlen_q=9)
    check(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kvcache(dtype, device):
    n, hq, hkv, d, bs, nblk = 11, 4, 3, 32, 8, 6
    qkv = torch.randn(n, (hq + 2 * hkv) * d, device=device).to(dtype)
    key = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    value = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    assert not key.is_contiguous()
    slots = torch.randperm(nblk * bs)[:n].to(device)
    slots[[2, 7]] = PAD_SLOT_ID
    kc = torch.randn(nblk, hkv, bs, d, device=device).to(dtype)
    vc = torch.randn_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    store_kvcache(key, value, kc, vc, slots)
    store_kvcache_ref(key, value, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_default_num_splits():
    cpu = torch.device("cpu")
    assert default_num_splits(256, 8, 1024, cpu) == 1
    assert default_num_splits(1, 1, 100, cpu) == 1  # short context: no split
    assert default_num_splits(1, 1, 8192, cpu) == 8  # 1 "SM" on CPU: two waves of 4 programs
    assert default_num_splits(1, 1, 384, cpu) == 2  # 3 splits of 128 keys, rounded down to 2
    assert default_num_splits(1, 1, 255, cpu) == 1  # not two splits of 128 keys
    # one-warp tiles: 8 programs a "SM", splits of >= 64 keys
    assert default_num_splits(1, 1, 8192, cpu, num_warps=1) == 16
    assert default_num_splits(1, 1, 255, cpu, num_warps=1) == 2
    assert default_num_splits(4, 1, 8192, cpu, num_warps=1) == 4  # 4 programs x 4 splits: two waves of 8
    assert default_num_splits(12, 1, 8192, cpu, num_warps=1) == 1  # 12 programs: already more than a wave


# ----------------------------------------------------------------------------- GPU sizes


GPU_MIXED = [(16, 128, g, torch.bfloat16) for g in (1, 2, 4, 8)] + [
    (8, 128, 2, torch.bfloat16),
    (32, 64, 4, torch.bfloat16),
    (64, 128, 1, torch.bfloat16),
    (16, 128, 2, torch.float16),
    (32, 64, 8, torch.float16),
    (16, 128, 2, torch.float32),
    (8, 64, 4, torch.float32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("bs,d,group,dtype", GPU_MIXED)
def test_gpu_mixed_large(bs, d, group, dtype, device):
    g = torch.Generator().manual_seed(bs * d + group)
    b = 24
    q_lens = [1 if i % 3 else int(torch.randint(2, 300, (1,), generator=g)) for i in range(b)]
    hist = [int(torch.randint(0, 1500, (1,), generator=g)) for _ in range(b)]
    hkv = 2
    c = make_case(q_lens, hist, hkv * group, hkv, d, bs, dtype, device, seed=group)
    ref = paged_attention_ref(**c)
    out = paged_attention(**c, max_seqlen_q=max(q_lens))
    check(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 8, 24])
@pytest.mark.parametrize("group", [2, 8])
def test_gpu_decode_long(num_splits, group, device):
    seq = [4097, 8192, 1, 3000, 777, 6000, 16, 8000]
    hkv, d, bs = 2, 128, 16
    c = make_case([1] * len(seq), [s - 1 for s in seq], hkv * group, hkv, d, bs, torch.bfloat16, device, seed=group)
    ref = paged_attention_ref(**c)
    c.pop("cu_seqlens_q")
    out = paged_attention_decode(**c, num_splits=num_splits, max_seqlen_k=8192)
    check(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_gpu_decode_cuda_graph(num_splits, device):
    """Captured decode attention replays correctly after the inputs change in place."""
    b, hq, hkv, d, bs = 8, 16, 8, 128, 16
    c = make_case([1] * b, [100 * i + 5 for i in range(b)], hq, hkv, d, bs, torch.bfloat16, device)
    c.pop("cu_seqlens_q")
    out = torch.empty_like(c["q"])
    paged_attention_decode(**c, num_splits=num_splits, out=out)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_decode(**c, num_splits=num_splits, out=out)
    c["q"].copy_(torch.randn_like(c["q"]))
    c["seq_lens"].sub_(3)
    graph.replay()
    torch.cuda.synchronize()
    cu = torch.arange(b + 1, dtype=torch.int32, device=device)
    ref = paged_attention_ref(**c, cu_seqlens_q=cu)
    check(out, ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_store_kvcache_large(device):
    n, hkv, d, bs, nblk = 4096, 8, 128, 16, 1024
    qkv = torch.randn(n, 3 * hkv * d, device=device, dtype=torch.bfloat16)
    key, value = qkv[:, : hkv * d].view(n, hkv, d), qkv[:, hkv * d : 2 * hkv * d].view(n, hkv, d)
    slots = torch.randperm(nblk * bs, device=device)[:n]
    slots[::17] = PAD_SLOT_ID
    kc = torch.randn(nblk, hkv, bs, d, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    store_kvcache(key, value, kc, vc, slots)
    store_kvcache_ref(key, value, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_pick_config_by_kv_format():
    """The bf16 choices stay what was measured; an fp8 cache reads its own rows of TILES."""
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    measured = dict(BLOCK_Q=8, BLOCK_N=64, num_warps=4, num_stages=2)
    assert _pick_config(True, 2, 128, bf16) == _pick_config(True, 2, 128, bf16, bf16) == measured
    assert _pick_config(False, 2, 128, bf16) == dict(measured, BLOCK_Q=32)
    n, w, s = TILES[("decode", "fp8")]
    assert _pick_config(True, 2, 128, bf16, e4m3) == dict(BLOCK_Q=8, BLOCK_N=n, num_warps=w, num_stages=s)
    assert _pick_config(True, 2, 128, torch.float32, e4m3)["BLOCK_N"] == 32  # fp32 q: narrow tiles
    # an fp8 decode in splits: its own row, V loaded beside K; a 16-bit cache has no such row
    n, w, s = TILES[("decode_split", "fp8")]
    split_tile = dict(BLOCK_Q=8, BLOCK_N=n, num_warps=w, num_stages=s, EARLY_V=True)
    assert _pick_config(True, 2, 128, bf16, e4m3, split=True) == split_tile
    assert _pick_config(True, 2, 128, bf16, bf16, split=True) == measured
    assert _pick_config(False, 2, 128, bf16, e4m3, split=True)["BLOCK_N"] == 64  # not a decode
    # head_dim 256 (Gemma): narrow tiles, and 8 warps for a prefill's [64, 256] accumulator
    assert _pick_config(False, 2, 256, bf16) == dict(BLOCK_Q=32, BLOCK_N=32, num_warps=8, num_stages=2)
    assert _pick_config(True, 2, 256, bf16) == dict(BLOCK_Q=8, BLOCK_N=32, num_warps=4, num_stages=2)


def test_attention_tiles_override(monkeypatch):
    """PAGEDLLM_ATTENTION_TILES replaces the rows it names, and a bad value names the variable."""
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    monkeypatch.setenv("PAGEDLLM_ATTENTION_TILES", '{"decode/fp8": [128, 4, 2]}')
    assert _pick_config(True, 2, 128, bf16, e4m3) == dict(BLOCK_Q=8, BLOCK_N=128, num_warps=4, num_stages=2)
    assert _pick_config(True, 2, 128, bf16) == dict(BLOCK_Q=8, BLOCK_N=64, num_warps=4, num_stages=2)
    monkeypatch.setenv("PAGEDLLM_ATTENTION_TILES", '{"decode_split/fp8": [16, 1, 2]}')
    assert _pick_config(True, 2, 128, bf16, e4m3, split=True) == dict(
        BLOCK_Q=8, BLOCK_N=16, num_warps=1, num_stages=2, EARLY_V=True
    )
    bads = ('{"decode/int4": [64, 1, 1]}', '{"decode/fp8": [64, 1]}', '{"decode_split/16bit": [32, 1, 1]}')
    for bad in (*bads, "[1, 2]", "not json"):
        monkeypatch.setenv("PAGEDLLM_ATTENTION_TILES", bad)
        with pytest.raises(ValueError, match="PAGEDLLM_ATTENTION_TILES"):
            _pick_config(True, 2, 128, bf16, e4m3)


def test_one_warp_fp8_decode_matches_reference(device):
    """The fp8 decode tiles (one warp) over splits, GQA groups and a padding row, against the reference:
    one split runs TILES' decode row, more (given, or the default) its decode_split row (V beside K)."""
    torch.manual_seed(0)
    e4m3 = torch.float8_e4m3fn
    for group, splits in ((2, 1), (4, 3), (1, 2), (2, None)):
        hkv, d, bs = 2, 32, 8
        lens = [70, 0, 129]
        nb = [-(-n // bs) for n in lens]
        k = (torch.randn(sum(nb) + 1, hkv, bs, d, device=device) / 2).to(e4m3)
        v = (torch.randn_like(k, dtype=torch.float32) / 2).to(e4m3)
        bt = torch.zeros(len(lens), max(nb), dtype=torch.int32, device=device)
        perm, used = torch.randperm(sum(nb) + 1, device=device).int(), 0
        for i, n in enumerate(nb):
            bt[i, :n] = perm[used : used + n]
            used += n
        q = torch.randn(len(lens), hkv * group, d, device=device, dtype=torch.bfloat16)
        sl = torch.tensor(lens, dtype=torch.int32, device=device)
        cu = torch.arange(len(lens) + 1, dtype=torch.int32, device=device)
        kw = dict(scale=d**-0.5, k_scale=0.5, v_scale=2.0)
        cfg = _pick_config(True, group, d, torch.bfloat16, e4m3)
        assert cfg["num_warps"] == 1
        out = paged_attention(q, k, v, bt, None, sl, max_seqlen_q=1, num_splits=splits, **kw)
        ref = paged_attention_ref(q, k, v, bt, cu, sl, **kw)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert out[1].abs().max() == 0  # the padding row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_step_as_whole_step_graphs_run_it(dtype, device):
    """worker/mixed_graphs.py replays a step padded to its captured bucket: more token rows than
    the sequences own (they belong to none), sequences with no new tokens (cu_seqlens_q repeats,
    seq_len 0) and a grid sized by the bucket (max_seqlen_q = T). The real rows must come out as
    without the padding, and the padding must neither be read nor stored anywhere."""
    bs, d, hkv, group = 16, 64, 2, 2
    q_lens, hist = [1, 21, 1, 5], [30, 17, 64, 0]
    c = make_case(q_lens, hist, hkv * group, hkv, d, bs, dtype, device, seed=7)
    ref = paged_attention_ref(**c)
    n, t, b = sum(q_lens), 64, 8  # buckets: 64 token rows, 8 sequences
    padded = dict(c)
    padded["q"] = torch.cat([c["q"], torch.full((t - n, *c["q"].shape[1:]), float("nan"), dtype=dtype, device=device)])
    cu = c["cu_seqlens_q"]
    padded["cu_seqlens_q"] = torch.cat([cu, cu[-1].repeat(b - len(q_lens))])
    padded["seq_lens"] = torch.cat([c["seq_lens"], c["seq_lens"].new_zeros(b - len(q_lens))])
    bt = c["block_tables"]
    padded["block_tables"] = torch.cat([bt, bt.new_zeros(b - len(q_lens), bt.shape[1])])
    out = paged_attention(**padded, max_seqlen_q=t)
    check(out[:n], ref, dtype)
