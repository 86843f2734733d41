"""Sliding-window and soft-capped attention: the torch references and the Triton kernels against a
plain dense masked attention written here, over ragged batches of decodes and prefills with cached
prefixes.

Every block-table entry wholly before a sequence's first query's window names a poison block full
of NaN (the cache's last block): the engine may give those blocks back, so they must never be
read, and a reference or kernel that reads one returns NaN. Every other slot no sequence owns holds
zeros, as the engine's KV tensor starts.
"""

import math

import pytest
import torch

from pagedllm.ops import PAD_SLOT_ID
from pagedllm.ops.attention_metadata import AttentionMetadata
from pagedllm.ops.attention_ref import (
    hidden,
    paged_attention_grouped,
    paged_attention_ref,
    paged_decode_attention_grouped,
    prefill_attention_ref,
    store_kvcache_ref,
)
from pagedllm.ops.kernels import TorchKernels
from pagedllm.ops.kv_quant import dequantize_ref


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """The mask written out: causal, and within the last `window` positions."""
    return (k_pos <= q_pos) & (k_pos > q_pos - window) if window is not None else k_pos <= q_pos


def dense(q, ks, vs, q_pos, scale, window, cap, visible=visible):
    """One sequence: q [L, Hq, D] at positions q_pos, over its whole K/V [S, Hkv, D]; float32."""
    group = q.shape[1] // ks.shape[1]
    k = ks.float().repeat_interleave(group, 1)  # [S, Hq, D]
    v = vs.float().repeat_interleave(group, 1)
    s = torch.einsum("lhd,shd->hls", q.float(), k) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    mask = ~visible(torch.tensor(q_pos)[:, None], torch.arange(ks.shape[0])[None, :], window)
    p = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
    return torch.einsum("hls,shd->lhd", p, v)


def make_case(q_lens, hist, hq, hkv, d, bs, window, seed=0, kv_dtype=None, dtype=torch.float32, device="cpu"):
    """A ragged batch stored in a paged cache; the table entries before each window name the poison
    block. Returns (args of paged_attention_ref, per-sequence dense K/V as stored, q positions)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + h for q, h in zip(q_lens, hist, strict=True)]
    nb = [math.ceil(s / bs) for s in seq_lens]
    num_blocks = sum(nb) + 3
    poison = num_blocks - 1
    k_cache = torch.zeros(num_blocks, hkv, bs, d, dtype=kv_dtype or dtype)
    k_cache[poison] = float("nan")
    v_cache = k_cache.clone()
    perm = torch.randperm(num_blocks - 1, generator=g)
    bt = torch.zeros(len(q_lens), max(nb) + 2, dtype=torch.int32)  # padding columns: block 0, zeros
    used, ks, vs, slots = 0, [], [], []
    for b, (n, s) in enumerate(zip(nb, seq_lens, strict=True)):
        bt[b, :n] = perm[used : used + n].int()
        used += n
        pos = torch.arange(s)
        slots.append(bt[b, pos // bs].long() * bs + pos % bs)
        ks.append(torch.randn(s, hkv, d, generator=g).to(dtype))
        vs.append(torch.randn(s, hkv, d, generator=g).to(dtype))
    k_scale = v_scale = 1.0 if kv_dtype is None else 0.02
    store_kvcache_ref(torch.cat(ks), torch.cat(vs), k_cache, v_cache, torch.cat(slots), k_scale, v_scale)
    if kv_dtype is not None:  # what the cache holds, dequantized
        ks = [dequantize_ref(quant, k_scale) for quant in _stored(k_cache, bt, seq_lens)]
        vs = [dequantize_ref(quant, v_scale) for quant in _stored(v_cache, bt, seq_lens)]
    for b, (q, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        first = max(0, s - q - window + 1) if window is not None else 0
        bt[b, : first // bs] = poison  # wholly before the first query's window: never read
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(dtype)
    q_pos = [list(range(s - q, s)) for q, s in zip(q_lens, seq_lens, strict=True)]
    args = dict(
        q=q.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=bt.to(device),
        cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        scale=d**-0.5,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return args, ks, vs, q_pos


def _stored(cache, bt, seq_lens):
    bs = cache.shape[2]
    return [cache[bt[b, torch.arange(s) // bs].long(), :, torch.arange(s) % bs] for b, s in enumerate(seq_lens)]


def dense_batch(args, ks, vs, q_pos, window, cap, visible=visible):
    cu = args["cu_seqlens_q"].tolist()
    parts = [
        dense(args["q"][cu[b] : cu[b + 1]].cpu(), ks[b], vs[b], q_pos[b], args["scale"], window, cap, visible)
        for b in range(len(ks))
        if cu[b + 1] > cu[b]
    ]
    return torch.cat(parts).to(args["q"].dtype)


MIXED = ([1, 9, 1, 0, 23, 4, 1], [12, 40, 70, 9, 0, 32, 0])  # decodes, prefills over prefixes, q_len 0


@pytest.mark.parametrize(
    "window,bs,cap",  # window 1; smaller than, equal to and larger than the contexts; on block edges
    [(1, 8, None), (5, 16, 5.0), (16, 16, None), (17, 8, 5.0), (200, 16, None)],
)
def test_references_match_dense_masked_attention(window, bs, cap):
    args, ks, vs, q_pos = make_case(*MIXED, 4, 2, 16, bs, window, seed=window + bs)
    want = dense_batch(args, ks, vs, q_pos, window, cap)
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(paged_attention_ref(**args, **kw), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(paged_attention_grouped(**args, **kw), want, rtol=1e-5, atol=1e-5)
    args.pop("cu_seqlens_q")
    dec = [i for i, n in enumerate(MIXED[0]) if n == 1]
    rows = torch.tensor(dec)
    cu = [0, *torch.tensor(MIXED[0]).cumsum(0).tolist()]
    got = paged_decode_attention_grouped(
        args["q"][[cu[i] for i in dec]],
        args["k_cache"],
        args["v_cache"],
        args["block_tables"][rows],
        args["seq_lens"][rows],
        args["scale"],
        pad_budget=1,  # one group per length: more than one group
        **kw,
    )
    torch.testing.assert_close(got, want[[cu[i] for i in dec]], rtol=1e-5, atol=1e-5)


def test_window_and_cap_change_the_result():
    """The cases can fail: no window, or no cap, gives clearly different outputs."""
    args, ks, vs, q_pos = make_case(*MIXED, 4, 2, 16, 8, None)
    full = paged_attention_ref(**args)
    torch.testing.assert_close(full, dense_batch(args, ks, vs, q_pos, None, None), rtol=1e-5, atol=1e-5)
    assert (paged_attention_ref(**args, sliding_window=6) - full).abs().max() > 0.1
    assert (paged_attention_ref(**args, logits_soft_cap=0.5) - full).abs().max() > 0.05
    # a window covering every context is full attention
    torch.testing.assert_close(paged_attention_grouped(**args, sliding_window=200), full, rtol=1e-6, atol=1e-6)


def test_hf_mask_function_is_the_window():
    masking_utils = pytest.importorskip("transformers.masking_utils")
    for w in (1, 3, 8):
        hf = masking_utils.sliding_window_causal_mask_function(w)
        q, k = torch.arange(20)[:, None], torch.arange(20)[None, :]
        want = ~hf(torch.tensor(0), torch.tensor(0), q, k)
        assert torch.equal(hidden(torch.arange(20), torch.arange(20), w), want)

        def hf_visible(qp, kp, window, hf=hf):
            return hf(torch.tensor(0), torch.tensor(0), qp, kp)

        args, ks, vs, q_pos = make_case([1, 6], [9, 4], 2, 1, 16, 4, w, seed=w)
        want_out = dense_batch(args, ks, vs, q_pos, w, None, hf_visible)
        torch.testing.assert_close(paged_attention_grouped(**args, sliding_window=w), want_out, rtol=1e-5, atol=1e-5)


def test_window_bounds_the_references_work():
    """Windowed decode and prefill-over-a-prefix cost the same at context 2,000 as at 60 (flops
    counted): only the window's blocks are gathered, whatever the context."""
    from torch.utils.flop_counter import FlopCounterMode

    def flops(hist):
        args, *_ = make_case([1, 1, 6], hist, 4, 2, 16, 8, 16)
        with FlopCounterMode(display=False) as counter:
            paged_attention_grouped(**args, sliding_window=16)
        return counter.get_total_flops()

    assert flops([2000, 1500, 2000]) == flops([60, 70, 60]) > 0
    # while full attention over those contexts costs far more
    args, *_ = make_case([1, 1, 6], [2000, 1500, 2000], 4, 2, 16, 8, None)
    with FlopCounterMode(display=False) as counter:
        paged_attention_grouped(**args)
    assert counter.get_total_flops() > 10 * flops([60, 70, 60])


def test_fp8_cache_with_window_and_cap():
    args, ks, vs, q_pos = make_case(*MIXED, 4, 2, 16, 8, 12, kv_dtype=torch.float8_e4m3fn)
    want = dense_batch(args, ks, vs, q_pos, 12, 10.0)
    got = paged_attention_grouped(**args, sliding_window=12, logits_soft_cap=10.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _meta(args, decode_only, no_history):
    cu, sl = args["cu_seqlens_q"], args["seq_lens"]
    q_lens = (cu[1:] - cu[:-1]).tolist()
    return AttentionMetadata(
        slot_mapping=torch.full((int(cu[-1]),), PAD_SLOT_ID, dtype=torch.int64),
        block_tables=args["block_tables"],
        cu_seqlens_q=cu,
        seq_lens=sl,
        max_seqlen_q=max(q_lens),
        max_seqlen_k=int(sl.max()),
        decode_only=decode_only,
        no_history=no_history,
    )


@pytest.mark.parametrize("cap", [None, 3.0])
def test_cpu_kernels_pass_window_and_cap_on_every_path(cap):
    """TorchKernels.attend: decode-only, mixed, pure prefill (cache or no cache) all windowed."""
    kern, w = TorchKernels(), 7
    for q_lens, hist, dec, nohist in [
        ([1, 1, 1], [30, 4, 17], True, False),
        (*MIXED, False, False),
        ([12, 5, 20], [0, 0, 0], False, True),
    ]:
        args, ks, vs, q_pos = make_case(q_lens, hist, 4, 2, 16, 8, w, seed=len(q_lens))
        want = dense_batch(args, ks, vs, q_pos, w, cap)
        q, kc, vc, scale = args["q"], args["k_cache"], args["v_cache"], args["scale"]
        kv = torch.cat(ks) if nohist else q[:, :2]  # pure prefill reads the new K/V directly
        vv = torch.cat(vs) if nohist else q[:, :2]
        meta = _meta(args, dec, nohist)
        got = kern.attend(q, kv, vv, kc, vc, meta, scale, sliding_window=w, logits_soft_cap=cap)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if nohist:  # the profiling run: no cache at all
            empty = torch.tensor([])
            got = kern.attend(q, kv, vv, empty, empty, meta, scale, sliding_window=w, logits_soft_cap=cap)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            got = prefill_attention_ref(q, kv, vv, args["cu_seqlens_q"], scale, sliding_window=w, logits_soft_cap=cap)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("w", [None, 7])
def test_profile_run_attention_batches_equal_lengths_exactly(cap, w):
    """prefill_attention_ref computes runs of equal-length sequences in one batched call (the
    profiling run's shape: every sequence one length, a few one longer): the same as one by one."""
    q_lens = [9, 9, 9, 4, 4, 11, 9, 9]
    args, ks, vs, q_pos = make_case(q_lens, [0] * len(q_lens), 4, 2, 16, 8, w or 10_000, seed=3)
    want = dense_batch(args, ks, vs, q_pos, w or 10_000, cap)
    got = prefill_attention_ref(
        args["q"],
        torch.cat(ks),
        torch.cat(vs),
        args["cu_seqlens_q"],
        args["scale"],
        sliding_window=w,
        logits_soft_cap=cap,
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- Triton kernels (interpreted on CPU) against the references ---------------------------------


@pytest.fixture
def triton_attention():
    pytest.importorskip("triton")
    from pagedllm.ops import paged_attention

    return paged_attention


def check(out, ref, dtype=torch.float32):
    assert torch.isfinite(out).all()  # NaN: a poisoned block (before a window) was read
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


DECODE = [1, 6, 40, 130]  # contexts below, equal to and far above the windows


@pytest.mark.parametrize("window,num_splits,cap", [(1, 1, None), (29, 3, 4.0), (200, 2, None)])
def test_triton_decode_with_window(window, num_splits, cap, triton_attention, device):
    args, ks, vs, q_pos = make_case([1] * len(DECODE), [s - 1 for s in DECODE], 4, 2, 32, 8, window, device=device)
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    ref = paged_attention_ref(**args, **kw)
    check(ref, dense_batch(args, ks, vs, q_pos, window, cap).to(ref.device))
    args.pop("cu_seqlens_q")
    check(triton_attention.paged_attention_decode(**args, num_splits=num_splits, **kw), ref)


@pytest.mark.parametrize("window,num_splits,cap,d", [(29, 3, 4.0, 32), (200, 2, None, 32), (29, 4, 4.0, 256)])
def test_triton_fp8_decode_in_splits_with_window(window, num_splits, cap, d, triton_attention, device):
    """An fp8 decode in splits runs TILES' decode_split row (V loaded beside K): windows, caps and
    the poisoned blocks before a window (never read), at Gemma's head size too."""
    e4m3 = torch.float8_e4m3fn
    args, ks, vs, q_pos = make_case(
        [1] * len(DECODE),
        [s - 1 for s in DECODE],
        4,
        2,
        d,
        8,
        window,
        kv_dtype=e4m3,
        dtype=torch.bfloat16,
        device=device,
    )
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    ref = paged_attention_ref(**args, **kw)
    args.pop("cu_seqlens_q")
    check(triton_attention.paged_attention_decode(**args, num_splits=num_splits, **kw), ref, torch.bfloat16)


@pytest.mark.parametrize("window,num_splits", [(5, 1), (19, 1), (40, 2)])
def test_triton_prefill_with_prefix_and_window(window, num_splits, triton_attention, device):
    """Small tiles (BLOCK_Q 8 x GQA 2, BLOCK_N 16) so that query tiles have window edges, fully
    visible tiles and diagonals; split-K over a varlen batch too."""
    q_lens, hist = [1, 19, 2, 9], [50, 13, 33, 0]
    args, *_ = make_case(q_lens, hist, 4, 2, 32, 8, window, seed=window, device=device)
    kw = dict(sliding_window=window, logits_soft_cap=2.5 if window == 19 else None)
    ref = paged_attention_ref(**args, **kw)
    cfg = dict(BLOCK_Q=8, BLOCK_N=16)
    out = triton_attention.paged_attention(**args, max_seqlen_q=19, num_splits=num_splits, _config=cfg, **kw)
    check(out, ref)


def test_triton_soft_cap_without_window(triton_attention, device):
    args, ks, vs, q_pos = make_case([1, 7, 1], [20, 9, 3], 4, 2, 32, 16, None, device=device)
    args["q"] = args["q"] * 8  # scores well past the cap, where tanh saturates
    ref = paged_attention_ref(**args, logits_soft_cap=3.0)
    check(ref, dense_batch(args, ks, vs, q_pos, None, 3.0).to(ref.device))
    assert (ref - paged_attention_ref(**args)).abs().max() > 0.05
    check(triton_attention.paged_attention(**args, max_seqlen_q=7, logits_soft_cap=3.0), ref)


def test_triton_fp8_and_bf16_with_window(triton_attention, device):
    q_lens, hist = [1, 12, 1], [45, 20, 9]
    args, *_ = make_case(q_lens, hist, 4, 2, 32, 8, 13, kv_dtype=torch.float8_e4m3fn, device=device)
    kw = dict(sliding_window=13, logits_soft_cap=6.0)
    check(triton_attention.paged_attention(**args, max_seqlen_q=12, **kw), paged_attention_ref(**args, **kw))
    args, *_ = make_case(q_lens, hist, 4, 2, 32, 8, 13, dtype=torch.bfloat16, device=device)
    ref = paged_attention_ref(**args, **kw)
    check(triton_attention.paged_attention(**args, max_seqlen_q=12, **kw), ref, torch.bfloat16)


def test_triton_head_dim_256(triton_attention, device):
    """Gemma's head_dim, at its own tile choice (BLOCK_N 32), windowed decode and prefill."""
    args, *_ = make_case([1, 5], [40, 30], 2, 1, 256, 16, 24, device=device)
    kw = dict(sliding_window=24, logits_soft_cap=50.0)
    check(triton_attention.paged_attention(**args, max_seqlen_q=5, **kw), paged_attention_ref(**args, **kw))


# ---- GPU sizes ----------------------------------------------------------------------------------

GPU_WINDOWED = [(128, 512, None), (128, 4096, 30.0), (256, 512, 50.0), (256, 4096, None)]


@pytest.mark.gpu
@pytest.mark.parametrize("d,window,cap", GPU_WINDOWED)
def test_gpu_windowed_attention_large(d, window, cap, triton_attention, device):
    """Gemma-like heads (GQA 2, head_dim 128/256), windows 512/4096, contexts up to 8k: decode
    (default and forced split-K) and prefill chunks over long prefixes, bf16."""
    g = torch.Generator().manual_seed(d + window)
    seq = [8192, 1, 600, 4096, 5000, 7000, 100, 4600]
    q_lens = [1 if i % 2 else int(torch.randint(2, 400, (1,), generator=g)) for i in range(len(seq))]
    hist = [max(0, s - q) for s, q in zip(seq, q_lens, strict=True)]
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    args, *_ = make_case(q_lens, hist, 4, 2, d, 16, window, dtype=torch.bfloat16, device=device)
    ref = paged_attention_ref(**args, **kw)
    check(triton_attention.paged_attention(**args, max_seqlen_q=max(q_lens), **kw), ref, torch.bfloat16)
    dec, *_ = make_case([1] * len(seq), [s - 1 for s in seq], 8, 2, d, 16, window, dtype=torch.bfloat16, device=device)
    ref = paged_attention_ref(**dec, **kw)
    dec.pop("cu_seqlens_q")
    for splits in (None, 1, 8):
        out = triton_attention.paged_attention_decode(**dec, num_splits=splits, max_seqlen_k=8192, **kw)
        check(out, ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_windowed_decode_cuda_graph(triton_attention, device):
    """Captured windowed, soft-capped decode replays correctly after the contexts grow in place."""
    b, window = 8, 64
    args, *_ = make_case([1] * b, [300 * i + 5 for i in range(b)], 8, 4, 256, 16, None, dtype=torch.bfloat16)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    args.pop("cu_seqlens_q")
    kw = dict(sliding_window=window, logits_soft_cap=50.0, num_splits=2)
    out = torch.empty_like(args["q"])
    triton_attention.paged_attention_decode(**args, out=out, **kw)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_attention.paged_attention_decode(**args, out=out, **kw)
    args["q"].copy_(torch.randn_like(args["q"]))
    args["seq_lens"].sub_(3)
    graph.replay()
    torch.cuda.synchronize()
    cu = torch.arange(b + 1, dtype=torch.int32, device=device)
    ref = paged_attention_ref(**args, cu_seqlens_q=cu, sliding_window=window, logits_soft_cap=50.0)
    check(out, ref, torch.bfloat16)
