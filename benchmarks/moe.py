"""The fused MoE kernel alone (CUDA only): decode (1..256 tokens) and prefill (8192 tokens) at the
expert shapes of Qwen3-30B-A3B (128 experts, hidden 2048, intermediate 768, top-8) and
Mixtral-8x7B (8 experts, hidden 4096, intermediate 14336, top-2), bf16, random routing.

Each case reports the kernel's time (replayed in a CUDA graph, as decode runs in the engine), the
achieved weight-read bandwidth (bytes of the experts the routing touches / time, TB/s) against a
device copy's bandwidth, TFLOP/s (6 * H * I FLOPs per (token, expert) pair) against the H200's
dense bf16 rate, and the torch reference's time; the kernel's output is checked against the
reference in every case.

    python benchmarks/moe.py [--shape qwen3-30b-a3b|mixtral-8x7b|all] [--out FILE] [--sweep]

--sweep times a grid of block configurations at M = 1, 4, 16, 64, 256, 1024, 8192 tokens within
--sweep-seconds and writes the best per M (and the MOE_CONFIGS table it suggests for
ops/fused_moe.py) under "sweep".
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from pagedllm.bench.common import device_copy_TBps, environment  # noqa: E402
from pagedllm.ops.fused_moe import config_for, fused_moe  # noqa: E402
from pagedllm.ops.moe_ref import fused_moe_ref, select_experts  # noqa: E402

SHAPES = {  # experts, hidden, expert intermediate, top-k
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}
DECODE_M = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL_M = [8192]
SWEEP_M = [1, 4, 16, 64, 256, 1024, 8192]
DEVICE = "cuda"
H200_BF16_TFLOPS = 989.0  # dense bf16 matrix rate (spec sheet)


def expert_weights(e: int, h: int, i: int):
    torch.manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device=DEVICE, dtype=torch.bfloat16) / h**0.5
    w2 = torch.randn(e, h, i, device=DEVICE, dtype=torch.bfloat16) / i**0.5
    return w13, w2


def inputs(m: int, e: int, h: int, k: int, seed: int = 1):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, h, device=DEVICE, dtype=torch.bfloat16, generator=g)
    weights, ids = select_experts(torch.randn(m, e, device=DEVICE, generator=g), k, renormalize=True)
    return x, weights, ids


def graph_ms(x, w13, w2, weights, ids, cfg: dict | None, rep: int) -> float:
    """The kernel's time in ms, replayed in a CUDA graph (as the engine's decode runs it)."""
    return do_bench_cudagraph(lambda: fused_moe(x, w13, w2, weights, ids, config=cfg), rep=rep)


def case(shape: str, m: int, w13, w2, copy_tbps: float, with_ref: bool = True) -> dict:
    e, h, i, k = SHAPES[shape]
    x, weights, ids = inputs(m, e, h, k)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    assert err < 2e-2, f"{shape} M={m}: relative error {err}"
    ms = graph_ms(x, w13, w2, weights, ids, None, rep=100)
    touched = int(torch.unique(ids).numel())
    weight_bytes = touched * 3 * h * i * w13.element_size()
    flops = 6 * m * k * h * i
    row = dict(
        shape=shape,
        M=m,
        experts_touched=touched,
        config=config_for(m),
        ms=round(ms, 4),
        weight_TBps=round(weight_bytes / ms / 1e9, 3),
        weight_vs_copy=round(weight_bytes / ms / 1e9 / copy_tbps, 3),
        TFLOPs=round(flops / ms / 1e9, 1),
        TFLOPs_vs_bf16_peak=round(flops / ms / 1e9 / H200_BF16_TFLOPS, 3),
        rel_err_vs_ref=round(err, 5),
    )
    if with_ref:
        row["ref_ms"] = round(do_bench(lambda: fused_moe_ref(x, w13, w2, weights, ids), warmup=5, rep=30), 3)
        row["speedup_vs_ref"] = round(row["ref_ms"] / ms, 2)
    return row


def sweep_grid(decode: bool):
    """Block configurations worth trying: for decode (few tokens per expert) small BLOCK_M and narrow
    tiles for more programs; for prefill large tiles, grouped for L2 reuse."""
    if decode:
        grid = itertools.product((16, 32), (32, 64, 128), (64, 128), (1,), (4,), (3, 4))
    else:
        grid = itertools.product((64, 128), (64, 128), (64, 128), (8,), (4, 8), (3, 4))
    for bm, bn, bk, group, warps, stages in grid:
        yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=warps, num_stages=stages)


def sweep(shape: str, w13, w2, save, seconds: float) -> dict:
    """The best configuration per M among those tried within `seconds` (compiling dominates: each
    configuration is tried at every M of its regime before the next one); save(partial result)
    after each configuration, so a run cut short keeps what it measured."""
    e, h, i, k = SHAPES[shape]
    cases = {m: inputs(m, e, h, k) for m in SWEEP_M}
    refs = {m: fused_moe_ref(x, w13, w2, wt, ids).float() for m, (x, wt, ids) in cases.items()}
    best: dict = {}
    for m, (x, wt, ids) in cases.items():
        best[m] = dict(default=config_for(m), default_ms=round(graph_ms(x, w13, w2, wt, ids, None, 20), 4), tried=0)
    res: dict = dict(best_per_M=best)
    t0 = time.monotonic()
    for decode in (True, False):
        ms_of = [m for m in SWEEP_M if (m <= 64) == decode]
        for cfg in sweep_grid(decode):
            if time.monotonic() - t0 > seconds * (0.5 if decode else 1.0):
                break
            for m in ms_of:
                x, weights, ids = cases[m]
                try:
                    out = fused_moe(x, w13, w2, weights, ids, config=cfg).float()
                    if (out - refs[m]).abs().max() / refs[m].abs().max() > 2e-2:
                        continue
                    ms = graph_ms(x, w13, w2, weights, ids, cfg, rep=20)
                except Exception as exc:  # out of shared memory / registers: not a candidate
                    print(f"  skip {cfg}: {type(exc).__name__}", file=sys.stderr)
                    break
                row = best[m]
                row["tried"] += 1
                if "best_ms" not in row or ms < row["best_ms"]:
                    row.update(best_ms=round(ms, 4), best=cfg)
            save(res)
    print(json.dumps({shape: best}), file=sys.stderr, flush=True)
    bounds = [*SWEEP_M[:-1], None]  # M <= 1, <= 4, ... (upper bounds at the swept points), then any
    res["suggested_MOE_CONFIGS"] = [(b, best[m].get("best")) for b, m in zip(bounds, SWEEP_M, strict=True)]
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--sweep", action="store_true", help="also sweep block configurations (Qwen3-30B-A3B shape)")
    p.add_argument("--sweep-shape", choices=list(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--sweep-seconds", type=float, default=90.0, help="time budget of the sweep (default: 90)")
    args = p.parse_args(argv)
    copy_tbps = device_copy_TBps()  # eager: a copy captured in a graph reads ~2.8 TB/s, not ~4.3
    res: dict = dict(environment(), copy_TBps=round(copy_tbps, 3), cases=[])
    print(json.dumps({"copy_TBps": res["copy_TBps"]}), file=sys.stderr, flush=True)

    def save(sweep_res=None) -> None:  # after every case: a run cut short keeps what it measured
        if sweep_res is not None:
            res["sweep"] = {args.sweep_shape: sweep_res}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    for shape in SHAPES if args.shape == "all" else [args.shape]:
        e, h, i, _ = SHAPES[shape]
        w13, w2 = expert_weights(e, h, i)
        for m in DECODE_M + PREFILL_M:
            row = case(shape, m, w13, w2, copy_tbps)
            res["cases"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            save()
        if args.sweep and shape == args.sweep_shape:
            save(sweep(shape, w13, w2, save, args.sweep_seconds))
        del w13, w2
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
