"""Kernel micro-benchmarks (CUDA only): paged attention decode and prefill.

Decode reports achieved KV bandwidth (bytes of K and V read, in the cache's format, / kernel
time, TB/s) and its ratio to a device copy's bandwidth measured the same way (a 1 GiB tensor
copied, bytes read plus written: what the memory system sustains); prefill reports TFLOP/s
counting only the causally visible (query, key) pairs, 4 * head_dim FLOPs each (QK^T and PV).
Shapes follow Qwen3-0.6B: 16 query heads, 8 KV heads, head_dim 128, block_size 16, bf16 q.
Block tables are random permutations (no locality between blocks).

    python benchmarks/kernels.py [--out FILE] [--sweep] [--kv-cache-dtype auto|fp8|fp8_e5m2]

--kv-cache-dtype: the cache format of every case (auto: q's dtype, bf16); an fp8 cache holds
randn K/V quantized with per-tensor scales amax / fp8_max, and the check compares against the
reference dequantizing the same bytes. The default run always includes decode at batch 256 x
context 1024 with fp8 (e4m3) KV, the fp8 cache's headline number: fp8 KV bytes per second against the copy
bandwidth, the goal being >= 0.8 (`kv_vs_copy`).
--sweep also times a grid of tile configurations and split counts and reports the best (for
the --kv-cache-dtype given; the fp8 rows of paged_attention.TILES come from it).
--sliding-window W: instead, decode at contexts 1k..32k (batch 8 and 64) and prefill chunks over
growing prefixes, each with the window and without: windowed decode should cost about the same at
every context >= W (its keys start at the query's window), full attention grows with the context.
Decode KV bytes count the keys each query reads (min(context, W) with the window).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from pagedllm.engine.config import KV_CACHE_DTYPES  # noqa: E402
from pagedllm.ops.attention_ref import paged_attention_ref  # noqa: E402
from pagedllm.ops.kv_quant import FP8_DTYPES, fp8_max, quantize_ref  # noqa: E402
from pagedllm.ops.paged_attention import (  # noqa: E402
    _pick_config,
    default_num_splits,
    paged_attention,
)
from pagedllm.worker.device import resolve_kv_cache_dtype  # noqa: E402

HQ, HKV, D, BS, DTYPE = 16, 8, 128, 16, torch.bfloat16
DEVICE = "cuda"


def make_inputs(q_lens, seq_lens, kv_dtype=DTYPE, seed=0):
    """Arguments of paged_attention(_ref); k_scale / v_scale are 1.0 unless the cache is fp8."""
    torch.manual_seed(seed)
    dev = DEVICE
    nb = [math.ceil(s / BS) for s in seq_lens]
    num_blocks = sum(nb)
    k_cache = torch.randn(num_blocks, HKV, BS, D, device=dev, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    k_scale = v_scale = 1.0
    if kv_dtype != DTYPE:  # fp8: per-tensor scales from the data, as a calibration would give
        k_scale = k_cache.abs().max().item() / fp8_max(kv_dtype)
        v_scale = v_cache.abs().max().item() / fp8_max(kv_dtype)
        k_cache = quantize_ref(k_cache, k_scale, kv_dtype)
        v_cache = quantize_ref(v_cache, v_scale, kv_dtype)
    perm = torch.randperm(num_blocks, device=dev).int()
    bt = torch.zeros(len(seq_lens), max(nb), dtype=torch.int32, device=dev)
    used = 0
    for b, n in enumerate(nb):
        bt[b, :n] = perm[used : used + n]
        used += n
    cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device=dev)
    q = torch.randn(int(sum(q_lens)), HQ, D, device=dev, dtype=DTYPE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=bt,
        cu_seqlens_q=cu,
        seq_lens=sl,
        scale=D**-0.5,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def time_ms(fn, graph=False):
    fn()
    torch.cuda.synchronize()
    if graph:
        return do_bench_cudagraph(fn, rep=100)
    return do_bench(fn, warmup=25, rep=100)


def check(inp, out, max_seqlen_q, window=None):
    ref = paged_attention_ref(**inp, sliding_window=window)
    err = (out.float() - ref.float()).abs().max().item()
    assert err < 3e-2, f"max abs error {err}"
    return err


def bench_decode(batch, ctx, sweep, kv_dtype, copy_TBps, window=None):
    inp = make_inputs([1] * batch, [ctx] * batch, kv_dtype)
    read = min(ctx, window or ctx)  # keys each query reads
    kv_bytes = 2 * batch * read * HKV * D * inp["k_cache"].element_size()  # in the cache's format
    out = torch.empty_like(inp["q"])

    def run(num_splits=None, cfg=None):
        return lambda: paged_attention(
            **inp,
            max_seqlen_q=1,
            max_seqlen_k=ctx,
            num_splits=num_splits,
            out=out,
            sliding_window=window,
            _config=cfg,
        )

    splits = default_num_splits(batch, HKV, read, inp["q"].device)
    ms = time_ms(run())
    ms_graph = time_ms(run(), graph=True)
    err = check(inp, out, 1, window)
    res = dict(
        batch=batch,
        ctx=ctx,
        sliding_window=window,
        kv_dtype=str(kv_dtype),
        num_splits=splits,
        ms=ms,
        ms_graph=ms_graph,
        kv_TBps=kv_bytes / ms / 1e9,
        kv_TBps_graph=kv_bytes / ms_graph / 1e9,
        kv_vs_copy=kv_bytes / ms_graph / 1e9 / copy_TBps,
        max_abs_err=err,
        config=_pick_config(True, 2, D, DTYPE, kv_dtype),
    )
    if sweep:
        rows = []
        fp8 = kv_dtype != DTYPE
        if splits == 1:
            grid = itertools.product([1], [64, 128, 256] if fp8 else [32, 64, 128], [4, 8], [2, 3, 4])
        else:
            grid = itertools.product(sorted({4, 8, 16, 32, splits}), [64, 128, 256] if fp8 else [64, 128], [4], [3])
        for s, bn, nw, st in grid:
            cfg = dict(BLOCK_Q=8, BLOCK_N=bn, num_warps=nw, num_stages=st)
            try:
                t = time_ms(run(s, cfg), graph=True)
            except Exception as e:  # noqa: BLE001 - out of shared memory etc.
                rows.append(dict(splits=s, **cfg, error=type(e).__name__))
                continue
            rows.append(
                dict(splits=s, **cfg, ms=t, kv_TBps=kv_bytes / t / 1e9, kv_vs_copy=kv_bytes / t / 1e9 / copy_TBps)
            )
        ok = [r for r in rows if "ms" in r]
        res["sweep_best"] = sorted(ok, key=lambda r: r["ms"])[:5]
        res["sweep_n"] = len(rows)
    return res


def visible_pairs(new, hist, window=None):
    """(query, key) pairs a prefill chunk of `new` tokens over `hist` cached ones computes."""
    if window is None:
        return new * hist + new * (new + 1) // 2
    return sum(min(window, hist + i + 1) for i in range(new))


def bench_prefill(n_seqs, new, hist, sweep, kv_dtype, window=None):
    inp = make_inputs([new] * n_seqs, [new + hist] * n_seqs, kv_dtype)
    flops = 4 * D * HQ * n_seqs * visible_pairs(new, hist, window)
    out = torch.empty_like(inp["q"])

    def run(cfg=None):
        return lambda: paged_attention(**inp, max_seqlen_q=new, out=out, sliding_window=window, _config=cfg)

    ms = time_ms(run())
    err = check(inp, out, new, window)
    res = dict(
        n_seqs=n_seqs,
        new_tokens=new,
        history=hist,
        sliding_window=window,
        ms=ms,
        kv_dtype=str(kv_dtype),
        TFLOPs=flops / ms / 1e9,
        max_abs_err=err,
        config=_pick_config(False, 2, D, DTYPE, kv_dtype),
    )
    if sweep:
        rows = []
        for bm, bn, nw, st in [
            (64, 64, 4, 2),
            (64, 64, 4, 3),
            (64, 128, 4, 2),
            (64, 32, 4, 2),
            (64, 64, 8, 2),
            (128, 64, 8, 2),
            (128, 64, 8, 3),
            (128, 128, 8, 3),
            (128, 64, 4, 3),
            (256, 64, 8, 3),
            (128, 128, 8, 2),
            (128, 64, 8, 4),
            (256, 64, 8, 2),
            (256, 128, 8, 2),
            (128, 32, 4, 3),
            (64, 64, 4, 4),
        ]:
            cfg = dict(BLOCK_Q=bm // 2, BLOCK_N=bn, num_warps=nw, num_stages=st)
            try:
                t = time_ms(run(cfg))
            except Exception as e:  # noqa: BLE001
                rows.append(dict(BLOCK_M=bm, **cfg, error=type(e).__name__))
                continue
            rows.append(dict(BLOCK_M=bm, **cfg, ms=t, TFLOPs=flops / t / 1e9))
        ok = [r for r in rows if "ms" in r]
        res["sweep_best"] = sorted(ok, key=lambda r: r["ms"])[:4]
    return res


def copy_bandwidth():
    """A 1 GiB device-to-device copy, timed as decode is (plain and in a CUDA graph); TB/s of
    bytes read plus written."""
    x = torch.empty(1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    moved = 2 * x.numel()
    ms, ms_graph = time_ms(lambda: y.copy_(x)), time_ms(lambda: y.copy_(x), graph=True)
    return dict(bytes=moved, ms=ms, ms_graph=ms_graph, TBps=moved / ms / 1e9, TBps_graph=moved / ms_graph / 1e9)


def matrix_rate():
    """The bf16 matrix rate: torch.mm of 8192^3 (and of a prefill's projection, 4096 x 1024 x 4096)."""
    rows = {}
    for m, k, n in ((8192, 8192, 8192), (4096, 1024, 4096)):
        a = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
        b = torch.randn(k, n, device=DEVICE, dtype=DTYPE)
        ms = time_ms(lambda a=a, b=b: a @ b)
        rows[f"mm_{m}x{k}x{n}"] = dict(ms=ms, TFLOPs=2 * m * k * n / ms / 1e9)
    return rows


def torch_flash_prefill(new):
    """PyTorch's own flash attention on one causal sequence of `new` tokens (no cache): SDPA's flash
    backend (dense, GQA) and varlen flash (torch.nn.attention.varlen) where this torch has it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    flops = 4 * D * HQ * visible_pairs(new, 0)
    q = torch.randn(1, HQ, new, D, device=DEVICE, dtype=DTYPE)
    k = torch.randn(1, HKV, new, D, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    res = {}
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                ms = time_ms(
                    lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                )
            res[name] = dict(ms=ms, TFLOPs=flops / ms / 1e9)
        except Exception as e:  # noqa: BLE001
            res[name] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
    try:
        from torch.nn.attention.varlen import varlen_attn

        qv, kv_, vv = q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1), v[0].transpose(0, 1)
        kv_ = kv_.repeat_interleave(HQ // HKV, 1).contiguous()
        vv = vv.repeat_interleave(HQ // HKV, 1).contiguous()
        cu = torch.tensor([0, new], dtype=torch.int32, device=DEVICE)
        ms = time_ms(lambda: varlen_attn(qv, kv_, vv, cu, cu, new, new, is_causal=True))
        res["varlen_attn"] = dict(ms=ms, TFLOPs=flops / ms / 1e9)
    except Exception as e:  # noqa: BLE001
        res["varlen_attn"] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
    return res


def window_cases(window, kv, copy_TBps):
    """Each case with the window and without; contexts 1k..32k."""
    cases = []
    for ctx in (1024, 2048, 4096, 8192, 16384, 32768):
        for batch in (8, 64):
            for w in (None, window):
                tag = "full" if w is None else f"w{w}"
                cases.append(
                    (
                        f"decode_{batch}x{ctx}_{tag}",
                        lambda b=batch, c=ctx, w=w: bench_decode(b, c, False, kv, copy_TBps, w),
                    )
                )
    for hist in (0, 4096, 16384):
        for w in (None, window):
            tag = "full" if w is None else f"w{w}"
            cases.append(
                (f"prefill_2x2048_hist{hist}_{tag}", lambda h=hist, w=w: bench_prefill(2, 2048, h, False, kv, w))
            )
    return cases


def window_summary(res, window):
    """ms (CUDA graph for decode) with and without the window, per shape."""
    rows = []
    for name, r in res.items():
        if isinstance(r, dict) and name.endswith("_full") and f"{name[:-5]}_w{window}" in res:
            w = res[f"{name[:-5]}_w{window}"]
            key = "ms_graph" if "ms_graph" in r else "ms"
            rows.append(dict(case=name[:-5], ms_full=r[key], ms_window=w[key], speedup=r[key] / w[key]))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("--sweep", action="store_true", help="also time tile/split variants")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="the KV cache's format")
    ap.add_argument("--sliding-window", type=int, help="time decode/prefill with this window against full attention")
    ap.add_argument(
        "--prefill", action="store_true", help="instead: prefill at 4k tokens (with a cached prefix and without) "
        "against the matrix rate and PyTorch's flash attention"
    )  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs CUDA")
    kv = resolve_kv_cache_dtype(args.kv_cache_dtype, DTYPE, torch.device(DEVICE))
    fp8 = FP8_DTYPES["fp8"]
    t0 = time.time()
    res = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        shape=dict(hq=HQ, hkv=HKV, head_dim=D, block_size=BS, dtype=str(DTYPE), kv_cache_dtype=args.kv_cache_dtype),
    )
    res["copy"] = copy = copy_bandwidth()
    print(json.dumps({"copy": copy}), file=sys.stderr, flush=True)
    # the better of the two copy timings: copy_ of 2 GiB captured in a graph measured 2.8 TB/s on the
    # H200 against 4.25 eager, which would make a kernel look faster than the memory
    copy_TBps = max(copy["TBps"], copy["TBps_graph"])
    cases = [
        ("decode_256x1024", lambda: bench_decode(256, 1024, args.sweep, kv, copy_TBps)),
        ("decode_8x8192", lambda: bench_decode(8, 8192, args.sweep, kv, copy_TBps)),
        ("prefill_4x1024", lambda: bench_prefill(4, 1024, 0, args.sweep, kv)),
        ("prefill_4x1024_hist1024", lambda: bench_prefill(4, 1024, 1024, args.sweep, kv)),
        ("prefill_1x4096", lambda: bench_prefill(1, 4096, 0, False, kv)),
    ]
    if kv != fp8:  # the fp8 headline number is in every run
        cases.insert(1, ("decode_256x1024_fp8", lambda: bench_decode(256, 1024, False, fp8, copy_TBps)))
    if args.sliding_window:
        cases = window_cases(args.sliding_window, kv, copy_TBps)
    if args.prefill:
        cases = [
            ("matrix_rate", matrix_rate),
            ("prefill_1x4096", lambda: bench_prefill(1, 4096, 0, args.sweep, kv)),
            ("prefill_1x2048_hist2048", lambda: bench_prefill(1, 2048, 2048, args.sweep, kv)),
            ("prefill_1x4096_hist4096", lambda: bench_prefill(1, 4096, 4096, args.sweep, kv)),
            ("prefill_4x1024_hist1024", lambda: bench_prefill(4, 1024, 1024, False, kv)),
            ("torch_flash_1x4096", lambda: torch_flash_prefill(4096)),
        ]
    for name, fn in cases:
        res[name] = fn()
        print(json.dumps({name: res[name]}), file=sys.stderr, flush=True)  # progress
        torch.cuda.empty_cache()
    if args.sliding_window:
        res["window_summary"] = window_summary(res, args.sliding_window)
    res["wall_s"] = time.time() - t0
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
