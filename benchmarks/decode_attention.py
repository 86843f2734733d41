"""Decode attention against the copy bandwidth (CUDA only): tiles, warps and splits side by side.

Times `paged_attention` decode (one new token per sequence) in a CUDA graph
(`triton.testing.do_bench_cudagraph`) against a 1 GiB device copy timed the same way (bytes read
plus written), in the same process. KV bandwidth = bytes of K and V in the cache's format / time.
Every timed variant is checked against `paged_attention_ref` on the same inputs (max_abs_err).

    python benchmarks/decode_attention.py --out FILE [--variants] [--shapes] [--mixed]

--variants: the (BLOCK_N, num_warps, num_stages) grid at batch 256 x context 1,024 (Qwen3-0.6B's
attention: 16 query heads, 8 KV heads, head_dim 128, block 16), bf16 and fp8 (e4m3) KV.
--shapes: batch 1-256 x context 128-32k at group 2, GQA groups 1/2/4/8 and head sizes 64/128/256
at 256 x 1,024 and 8 x 8,192, and Gemma-3-1B's attention (4 heads on 1 KV head, head_dim 256):
the default (`TILES`, `default_num_splits`), the `CANDIDATES` tiles, and other split counts.
--mixed: mixed context lengths (as in the standard workload's decode steps) in three launch orders.
--mixed-tiles: the same mixed lengths, launched longest first, across tiles, warps, stages and
V's load beside K's (EARLY_V), each at two split counts.
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
from triton.testing import do_bench_cudagraph  # noqa: E402

from pagedllm.ops import paged_attention_kernels  # noqa: E402
from pagedllm.ops._triton import next_pow2  # noqa: E402
from pagedllm.ops.attention_metadata import longest_first  # noqa: E402
from pagedllm.ops.attention_ref import paged_attention_ref  # noqa: E402
from pagedllm.ops.kv_quant import fp8_max, quantize_ref  # noqa: E402
from pagedllm.ops.paged_attention import _pick_config, default_num_splits, paged_attention  # noqa: E402

BS, DTYPE, FP8 = 16, torch.bfloat16, torch.float8_e4m3fn
SMOKE = os.environ.get("DECODE_BENCH_SMOKE") == "1"  # tiny shapes on CPU through the interpreter: the script's own test
DEV = "cpu" if SMOKE else "cuda"


def make_inputs(batch, ctx, hkv, group, d, kv_dtype, seed=0, lens=None):
    """lens: per-sequence context lengths (default: every sequence `ctx`; the block tables are
    `ctx` wide either way)."""
    torch.manual_seed(seed)
    nb = math.ceil(ctx / BS)
    num_blocks = batch * nb
    k = torch.randn(num_blocks, hkv, BS, d, device=DEV, dtype=DTYPE)
    v = torch.randn_like(k)
    ks = vs = 1.0
    if kv_dtype == FP8:
        ks, vs = k.abs().max().item() / fp8_max(FP8), v.abs().max().item() / fp8_max(FP8)
        k, v = quantize_ref(k, ks, FP8), quantize_ref(v, vs, FP8)
    bt = torch.randperm(num_blocks, device=DEV).int().view(batch, nb)
    return dict(
        q=torch.randn(batch, hkv * group, d, device=DEV, dtype=DTYPE),
        k_cache=k,
        v_cache=v,
        block_tables=bt,
        cu_seqlens_q=None,
        seq_lens=(
            torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
            if lens is None
            else torch.tensor(lens, dtype=torch.int32, device=DEV)
        ),
        scale=d**-0.5,
        k_scale=ks,
        v_scale=vs,
    )


def compiled_info(kernel) -> dict:
    """Registers, spills and shared memory of the variant compiled last (best effort across triton versions)."""
    try:
        for cache in kernel.device_caches.values():
            table = cache[0] if isinstance(cache, tuple) else cache
            if table:
                k = list(table.values())[-1]
                return dict(regs=k.n_regs, spills=k.n_spills, smem=k.metadata.shared)
    except Exception as e:  # noqa: BLE001
        return dict(info_error=type(e).__name__)
    return {}


def copy_TBps() -> float:
    if SMOKE:
        return 1.0
    x = torch.empty(1024**3, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=100)
    ms_graph = do_bench_cudagraph(lambda: y.copy_(x), rep=100)

    return 2 * 1024**3 / min(ms, ms_graph) / 1e9


def time_case(inp, out, cfg, splits, extra=None):
    fn = lambda: paged_attention(**inp, max_seqlen_q=1, num_splits=splits, out=out, _config=cfg, **(extra or {}))  # noqa: E731
    fn()
    if SMOKE:
        return 1.0
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=60)


def run_case(batch, ctx, hkv, group, d, kv_dtype, copy, configs, lens=None, ordered=False):
    """configs: list of (label, cfg or None, splits or None). Returns one row per config.
    ordered: launch longest first through `seq_order` (as the engine does)."""
    if SMOKE:
        batch, ctx, hkv, d = min(batch, 2), min(ctx, 40), min(hkv, 2), min(d, 32)
        lens = None if lens is None else [min(x, ctx) for x in lens[:batch]]
    inp = make_inputs(batch, ctx, hkv, group, d, kv_dtype, lens=lens)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    ref = paged_attention_ref(**{k: v for k, v in inp.items() if k != "cu_seqlens_q"}, cu_seqlens_q=cu)
    kv_bytes = 2 * int(inp["seq_lens"].sum()) * hkv * d * inp["k_cache"].element_size()
    extra = dict(seq_order=torch.from_numpy(longest_first(inp["seq_lens"].cpu().numpy())).to(DEV)) if ordered else {}
    rows = []
    for label, cfg, splits in configs:
        out = torch.empty_like(inp["q"])
        kernel = paged_attention_kernels._paged_attn_kernel
        row = dict(label=label, cfg=cfg, splits=splits)
        try:
            ms = time_case(inp, out, cfg, splits, extra)
        except Exception as e:  # noqa: BLE001 - out of resources etc.
            rows.append(dict(row, error=f"{type(e).__name__}: {str(e)[:100]}"))
            continue
        err = (out.float() - ref.float()).abs().max().item()
        tbps = kv_bytes / ms / 1e9
        rows.append(dict(row, ms=ms, kv_TBps=tbps, vs_copy=tbps / copy, max_abs_err=err, **compiled_info(kernel)))
    cfg0 = _pick_config(True, next_pow2(group), d, DTYPE, kv_dtype)
    used = default_num_splits(batch, hkv, ctx, inp["q"].device, cfg0["num_warps"])
    head = dict(batch=batch, ctx=ctx, hkv=hkv, group=group, head_dim=d, kv=str(kv_dtype), default_splits=used)
    del inp
    torch.cuda.empty_cache()
    return dict(head, rows=rows)


def mixed(copy, save):
    """Mixed context lengths, as in a decode step of the standard workload (prompts of 100-1,024 tokens,
        outputs of 100-1,024): lengths uniform in [128, 1,536], the sequences in the order drawn, longest
        first and shortest first (the hardware starts programs in grid order), and as drawn but launched
    longest first through `seq_order` (the engine's way), at several split counts.
        Bandwidth counts the bytes of the actual lengths."""
    res = []
    for kv in (FP8, DTYPE):
        for batch in (32, 64, 128, 240):
            g = torch.Generator().manual_seed(batch)
            lens = torch.randint(128, 1537, (batch,), generator=g).tolist()
            if SMOKE:
                lens = [min(x, 40) for x in lens]
            for order in ("drawn", "drawn, seq_order", "longest first", "shortest first"):
                ls = lens if order.startswith("drawn") else sorted(lens, reverse=order == "longest first")
                cfg = _pick_config(True, 2, 128, DTYPE, kv)
                used = default_num_splits(batch, 8, max(ls), torch.device(DEV), cfg["num_warps"])
                configs = [("default", None, None)] + [(f"{sp} splits", cfg, sp) for sp in (1, 2, 4, 8) if sp != used]
                row = run_case(
                    batch, max(ls), 8, 2, 128, kv, copy, configs, lens=ls, ordered=order == "drawn, seq_order"
                )
                row.update(order=order, mean_len=sum(ls) / len(ls))
                res.append(row)
                save(res, "mixed")
                ok = sorted((r for r in row["rows"] if "ms" in r), key=lambda r: r["ms"])
                print(
                    json.dumps(
                        dict(
                            kv=fmt(kv),
                            batch=batch,
                            order=order,
                            default_splits=row["default_splits"],
                            rows=[(r["label"], round(r["ms"] * 1e3, 1), round(r["vs_copy"], 3)) for r in ok],
                        )
                    )
                )
    return res


# (BLOCK_N, num_warps, num_stages, EARLY_V) tried at mixed lengths (--mixed-tiles)
MIXED_TILES = [
    (64, 1, 1, False),
    (64, 1, 1, True),
    (64, 1, 2, False),
    (64, 1, 3, False),
    (32, 1, 1, False),
    (32, 1, 1, True),
    (32, 1, 2, False),
    (32, 1, 3, False),
    (64, 2, 1, True),
    (64, 2, 2, False),
    (128, 2, 1, True),
    (64, 4, 1, True),
    (64, 4, 2, False),
    (128, 4, 2, False),
]


def mixed_tiles(copy, save, batches=(16, 32, 64, 128, 240)):
    """The tile grid (MIXED_TILES: BLOCK_N, warps, stages, V loaded beside K) at mixed lengths
    (uniform 128-1,536, launched longest first through `seq_order`, as the engine does), each at its
    warps' default split count and at twice that: is one tile best at every batch size?"""
    res = []
    for kv in (FP8, DTYPE):
        for batch in batches:
            g = torch.Generator().manual_seed(batch)
            lens = torch.randint(128, 1537, (batch,), generator=g).tolist()
            if SMOKE:
                lens = [min(x, 40) for x in lens]
            configs = [("default", None, None)]
            for bn, nw, st, early in MIXED_TILES:
                cfg = dict(tile(kv, 2, 128, bn, nw, st), EARLY_V=early)
                sp = default_num_splits(batch, 8, 4096, torch.device(DEV), nw)  # the engine's max_seqlen_k
                label = f"{bn}/{nw}w/{st}s" + (" early V" if early else "")
                configs += [(label, cfg, sp), (label, cfg, 2 * sp)]
            row = run_case(batch, max(lens), 8, 2, 128, kv, copy, configs, lens=lens, ordered=True)
            row.update(order="drawn, seq_order", mean_len=sum(lens) / len(lens))
            res.append(row)
            save(res, "mixed_tiles")
            ok = sorted((r for r in row["rows"] if "ms" in r), key=lambda r: r["ms"])
            dflt = row["rows"][0]
            print(
                json.dumps(
                    dict(
                        kv=fmt(kv),
                        batch=batch,
                        default=(round(dflt.get("ms", 0) * 1e3, 1), round(dflt.get("vs_copy", 0), 3)),
                        best=[
                            (r["label"], r["splits"], round(r["ms"] * 1e3, 1), round(r["vs_copy"], 3)) for r in ok[:4]
                        ],
                        errors=sum("error" in r for r in row["rows"]),
                    )
                ),
                flush=True,
            )
    return res


def fmt(kv_dtype):
    return "fp8" if kv_dtype == FP8 else "16bit"


def tile(kv, group, d, bn, nw, st):
    return dict(_pick_config(True, next_pow2(group), d, DTYPE, kv), BLOCK_N=bn, num_warps=nw, num_stages=st)


def variants(copy):
    """The dot-tile grid at 256 x 1,024, both KV formats."""
    res = {}
    for kv in (DTYPE, FP8):
        configs = [("default", None, None)]
        if kv == FP8:
            configs.append(("before issue 30", tile(kv, 2, 128, 128, 4, 2), None))
        for nw, bn, st in itertools.product([1, 2, 4], [16, 32, 64, 128], [1, 2, 3]):
            if nw * 64 >= bn:
                configs.append(("tile", tile(kv, 2, 128, bn, nw, st), None))
        case = run_case(256, 1024, 8, 2, 128, kv, copy, configs)
        res[fmt(kv)] = case
        ok = sorted((r for r in case["rows"] if "ms" in r), key=lambda r: r["ms"])
        print(json.dumps({fmt(kv): [(r["cfg"], round(r["ms"], 4), round(r["vs_copy"], 3)) for r in ok[:6]]}))
    return res


# (BLOCK_N, num_warps, num_stages) tried beside the default at each shape
CANDIDATES = {
    ("fp8", "narrow"): [("before issue 30", (128, 4, 2)), ("1 warp, 32, 2 stages", (32, 1, 2))],
    ("fp8", "wide"): [
        ("before issue 30", (32, 4, 2)),
        ("1w 16/2", (16, 1, 2)),
        ("2w 32/1", (32, 2, 1)),
        ("2w 32/2", (32, 2, 2)),
    ],
    ("16bit", "narrow"): [("1w 16/2", (16, 1, 2)), ("1w 32/2", (32, 1, 2))],
    ("16bit", "wide"): [("1w 16/2", (16, 1, 2)), ("2w 32/2", (32, 2, 2)), ("2w 16/2", (16, 2, 2))],
}


def shapes(copy, save):
    """Every shape: the default (TILES and default_num_splits), the candidates, and for the shapes that
    split, the default tile at other split counts."""
    res = []
    grid = [(1, 1024), (1, 8192), (1, 32768), (8, 8192), (32, 4096), (64, 2048), (128, 1024), (256, 128)]
    grid += [(256, 1024), (256, 4096)]
    cases = [(b, c, 8, 2, 128) for b, c in grid]
    for b, c in ((256, 1024), (8, 8192)):
        cases += [(b, c, 8, g, 128) for g in (1, 4, 8)] + [(b, c, 8, 2, d) for d in (64, 256)]
    cases += [(64, 2048, 1, 4, 256), (256, 1024, 1, 4, 256)]  # Gemma-3-1B's attention: 4 heads on one KV head
    for kv in (DTYPE, FP8):
        for b, c, hkv, g, d in cases:
            configs = [("default", None, None)]
            for label, (bn, nw, st) in CANDIDATES[(fmt(kv), "wide" if d > 128 else "narrow")]:
                configs.append((label, tile(kv, g, d, bn, nw, st), None))
            cfg = _pick_config(True, next_pow2(g), d, DTYPE, kv)
            used = default_num_splits(b, hkv, c, torch.device(DEV), cfg["num_warps"])
            if b * hkv < 1024 and d == 128 and g == 2:
                for sp in (1, 2, 4, 8, 16, 32, 64, 128):
                    if sp != used and c // sp >= 64:
                        configs.append((f"default tile, {sp} splits", cfg, sp))
            row = run_case(b, c, hkv, g, d, kv, copy, configs)
            res.append(row)
            save(res)
            ok = sorted((r for r in row["rows"] if "ms" in r), key=lambda r: r["ms"])
            print(
                json.dumps(
                    {k: v for k, v in row.items() if k != "rows"}
                    | {"default": [(round(r["ms"], 4), round(r["vs_copy"], 3)) for r in row["rows"][:1]]}
                    | {"best": [(r["label"], r["splits"], round(r["ms"], 4), round(r["vs_copy"], 3)) for r in ok[:2]]}
                )
            )
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--shapes", action="store_true")
    ap.add_argument("--mixed", action="store_true")
    ap.add_argument("--mixed-tiles", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    res = dict(
        gpu="cpu (smoke)" if SMOKE else torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        commit=os.environ.get("PAGEDLLM_COMMIT", "unknown"),
        date=time.strftime("%Y-%m-%d"),
    )
    res["copy_TBps"] = copy = copy_TBps()
    print(json.dumps({"copy_TBps": copy}), flush=True)

    def save(rows=None, key="shapes"):
        if rows is not None:
            res[key] = rows
        res["wall_s"] = time.time() - t0
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    if args.variants:
        res["variants"] = variants(copy)
        save()
    if args.shapes:
        shapes(copy, save)
    if args.mixed:
        mixed(copy, save)
    if args.mixed_tiles:
        mixed_tiles(copy, save)
    save()


if __name__ == "__main__":
    main()
