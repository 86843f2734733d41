"""Decode attention against the copy bandwidth (CUDA only): the kernels side by side.

Times `paged_attention` decode (one new token per sequence) with the `_paged_attn_kernel` tile
(`BLOCK_Q x G_PAD` rows, the default before issue 30) and with `_decode_attn_kernel` (LANES
independent key lanes a program, ops/decode_attention_kernels.py) in the same process, each in a
CUDA graph (`triton.testing.do_bench_cudagraph`), against a 1 GiB device copy timed the same way
(bytes read plus written). KV bandwidth = bytes of K and V in the cache's format / time.
Every timed variant is checked against `paged_attention_ref` on the same inputs.

    python benchmarks/decode_attention.py --out FILE [--variants] [--shapes] [--config-json JSON]

--variants: tile/warp/stage/lane grids of both kernels at batch 256 x context 1,024 (Qwen3-0.6B's
attention: 16 query heads, 8 KV heads, head_dim 128, block 16), bf16 and fp8 (e4m3) KV; the
best `_decode_attn_kernel` configuration per KV format is then used by --shapes unless
--config-json gives one ({"16bit": {...}, "fp8": {...}}).
--shapes: batch 1-256 x context 128-32k at group 2, and GQA groups 1/2/4/8 and head sizes
64/128/256 at 256 x 1,024 and 8 x 8,192, both kernels, both KV formats.
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

from pagedllm.ops import decode_attention_kernels, paged_attention_kernels  # noqa: E402
from pagedllm.ops.attention_ref import paged_attention_ref  # noqa: E402
from pagedllm.ops.kv_quant import fp8_max, quantize_ref  # noqa: E402
from pagedllm.ops.paged_attention import _pick_config, default_num_splits, paged_attention  # noqa: E402

BS, DTYPE, FP8 = 16, torch.bfloat16, torch.float8_e4m3fn
SMOKE = os.environ.get("DECODE_BENCH_SMOKE") == "1"  # tiny shapes on CPU through the interpreter: the script's own test
DEV = "cpu" if SMOKE else "cuda"


def make_inputs(batch, ctx, hkv, group, d, kv_dtype, seed=0):
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
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=DEV),
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


def time_case(inp, out, cfg, splits):
    fn = lambda: paged_attention(**inp, max_seqlen_q=1, num_splits=splits, out=out, _config=cfg)  # noqa: E731
    fn()
    if SMOKE:
        return 1.0
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=60)


def run_case(batch, ctx, hkv, group, d, kv_dtype, copy, configs):
    """configs: list of (label, cfg or None, splits or None). Returns one row per config."""
    if SMOKE:
        batch, ctx, hkv, d = min(batch, 2), min(ctx, 40), min(hkv, 2), min(d, 32)
    inp = make_inputs(batch, ctx, hkv, group, d, kv_dtype)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    ref = paged_attention_ref(**{k: v for k, v in inp.items() if k != "cu_seqlens_q"}, cu_seqlens_q=cu)
    kv_bytes = 2 * batch * ctx * hkv * d * inp["k_cache"].element_size()
    rows = []
    for label, cfg, splits in configs:
        out = torch.empty_like(inp["q"])
        kernel = (
            decode_attention_kernels._decode_attn_kernel
            if cfg and "LANES" in cfg
            else paged_attention_kernels._paged_attn_kernel
        )
        row = dict(label=label, cfg=cfg, splits=splits)
        try:
            ms = time_case(inp, out, cfg, splits)
        except Exception as e:  # noqa: BLE001 - out of resources etc.
            rows.append(dict(row, error=f"{type(e).__name__}: {str(e)[:100]}"))
            continue
        err = (out.float() - ref.float()).abs().max().item()
        tbps = kv_bytes / ms / 1e9
        rows.append(dict(row, ms=ms, kv_TBps=tbps, vs_copy=tbps / copy, max_abs_err=err, **compiled_info(kernel)))
    used = default_num_splits(batch, hkv, ctx, inp["q"].device)
    head = dict(batch=batch, ctx=ctx, hkv=hkv, group=group, head_dim=d, kv=str(kv_dtype), default_splits=used)
    del inp
    torch.cuda.empty_cache()
    return dict(head, rows=rows)


def fmt(kv_dtype):
    return "fp8" if kv_dtype == FP8 else "16bit"


def variants(copy):
    res = {}
    best = {}
    for kv in (DTYPE, FP8):
        base = _pick_config(True, 2, 128, DTYPE, kv)
        configs = [("dot tile (default)", None, None)]
        for nw, bn, st in itertools.product([1, 2], [16, 32, 64], [1, 2]):
            configs.append(("dot tile", dict(base, BLOCK_N=bn, num_warps=nw, num_stages=st), None))
        for lanes, bn, st in itertools.product([2, 4], [16, 32, 64], [1, 2, 3]):
            if bn < 64 or st < 3:
                configs.append(("lanes", dict(LANES=lanes, BLOCK_N=bn, num_warps=lanes, num_stages=st), None))
        for lanes, bn, nw, st in [(8, 16, 8, 2), (8, 16, 4, 2), (4, 16, 2, 2), (2, 32, 1, 2), (4, 32, 8, 2)]:
            configs.append(("lanes", dict(LANES=lanes, BLOCK_N=bn, num_warps=nw, num_stages=st), None))
        case = run_case(256, 1024, 8, 2, 128, kv, copy, configs)
        res[fmt(kv)] = case
        ok = sorted((r for r in case["rows"] if "ms" in r and r["max_abs_err"] < 3e-2), key=lambda r: r["ms"])
        lanes = [r for r in ok if r["cfg"] and "LANES" in r["cfg"]]
        best[fmt(kv)] = lanes[0]["cfg"] if lanes else None
        print(
            json.dumps({fmt(kv): [(r["label"], r["cfg"], round(r["ms"], 4), round(r["vs_copy"], 3)) for r in ok[:8]]})
        )
        # split counts for the long-context shapes with the best lanes config
        if best[fmt(kv)]:
            cfg = best[fmt(kv)]
            for b, c in ((8, 8192), (1, 32768)):
                sp = [(f"lanes splits {s}", cfg, s) for s in (1, 2, 4, 8, 16, 32, 64) if s <= c // 128]
                res[f"{fmt(kv)}_{b}x{c}_splits"] = run_case(
                    b, c, 8, 2, 128, kv, copy, [("dot tile (default)", None, None)] + sp
                )
    return res, best


def shapes(copy, best, save):
    res = []
    grid = [(1, 1024), (1, 32768), (8, 8192), (32, 4096), (64, 2048), (128, 1024), (256, 128), (256, 1024), (256, 4096)]
    cases = [(b, c, 8, 2, 128) for b, c in grid]
    for b, c in ((256, 1024), (8, 8192)):
        cases += [(b, c, 8, g, 128) for g in (1, 4, 8)] + [(b, c, 8, 2, d) for d in (64, 256)]
    for kv in (DTYPE, FP8):
        cfg = best.get(fmt(kv))
        for b, c, hkv, g, d in cases:
            configs = [("dot tile (default)", None, None)]
            if cfg:
                configs.append(("lanes", dict(cfg), None))
            row = run_case(b, c, hkv, g, d, kv, copy, configs)
            res.append(row)
            save(res)
            print(
                json.dumps(
                    {k: v for k, v in row.items() if k != "rows"}
                    | {r["label"]: (round(r.get("ms", -1), 4), round(r.get("vs_copy", -1), 3)) for r in row["rows"]}
                )
            )
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--shapes", action="store_true")
    ap.add_argument("--config-json", help='{"16bit": cfg, "fp8": cfg} for --shapes instead of --variants\' best')
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
    best = json.loads(args.config_json) if args.config_json else {}

    def save(rows=None):
        if rows is not None:
            res["shapes"] = rows
        res["wall_s"] = time.time() - t0
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    if args.variants:
        res["variants"], found = variants(copy)
        best = best or found
        res["best_lanes"] = best
        save()
    if args.shapes:
        shapes(copy, best, save)
    save()


if __name__ == "__main__":
    main()
