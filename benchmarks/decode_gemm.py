"""The decode GEMM (ops/decode_gemm.py) against cuBLAS (`F.linear`) at a model's linear shapes, M = 1 .. 256
rows, bf16 (CUDA only).

Per (N, K, M): cuBLAS's time, the kernel's with its default configuration (`decode_gemm_config`) and its in-kernel split-K
sum (each weight copy with its own `tile_counters`, as each layer has), the
weight bytes each reads per second and their fraction of the device copy rate (a 1 GiB device copy,
bytes read plus written), and the kernel's largest difference from the float32 reference. Timed as a
decode step runs them: one CUDA graph calls the product over enough copies of the weight that they do
not stay in the 50 MB L2 (as a step's 28 layers do not), replayed; the time per call is the graph's
over the copies. Per M, `step_ms`: the shapes' times summed over the model's layers (the GEMM part of
one decode step, the LM head left out).

    python benchmarks/decode_gemm.py [--model qwen3-0.6b|llama-8b] [--m 1 4 16 64] [--sweep]

--sweep also times a grid of configurations (BLOCK_N, BLOCK_K, split, warps, stages) per shape and M and
reports the best beside the default. JSON rows on stdout and in $OUT/decode-gemm.json (OUT default: .).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from pagedllm.bench.common import device_copy_TBps, environment  # noqa: E402
from pagedllm.ops._triton import num_sms  # noqa: E402
from pagedllm.ops.decode_gemm import decode_gemm, decode_gemm_config, decode_gemm_ref, tile_counters  # noqa: E402

# (N, K) of one layer's linear layers: qkv, o, gate_up, down; and the layer count
MODELS = {
    "qwen3-0.6b": ([(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)], 28),
    "llama-8b": ([(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)], 32),
}
COLD_BYTES = 256 * 1024**2  # the weight copies a timed graph walks through: several times the L2


def timed(fn_of, copies: int, reps: int = 20) -> float:
    """ms per call of fn_of(i) over copies i = 0 .. copies - 1, one after another in one graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm-up (compiles) outside the capture
            fn_of(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn_of(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps / copies


def sweep_configs(m: int):
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    for bn, bk, split, warps, stages in itertools.product((16, 32, 64), (128, 256), (1, 2, 4, 8), (4,), (3, 4)):
        yield (block_m, bn, bk, split, warps, stages)


def measure(x: torch.Tensor, weights: list[torch.Tensor], copy: float, sweep: bool) -> dict:
    (m, k), n = x.shape, weights[0].shape[0]
    want = decode_gemm_ref(x, weights[0]).float()
    err = float(
        (decode_gemm(x, weights[0], counters=tile_counters(n, x.device)).float() - want).abs().max() / want.abs().max()
    )
    cublas_ms = timed(lambda i: F.linear(x, weights[i]), len(weights))
    config = decode_gemm_config(m, n, k, num_sms(x.device))
    counters = [tile_counters(n, x.device) for _ in weights]  # as each layer owns its own
    kernel_ms = timed(lambda i: decode_gemm(x, weights[i], counters=counters[i]), len(weights))
    wbytes = n * k * weights[0].element_size()
    row = dict(
        m=m,
        n=n,
        k=k,
        config=list(config),
        cublas_ms=cublas_ms,
        kernel_ms=kernel_ms,
        speedup_vs_cublas=cublas_ms / kernel_ms,
        cublas_weight_TBps=wbytes / (cublas_ms * 1e-3) / 1e12,
        kernel_weight_TBps=wbytes / (kernel_ms * 1e-3) / 1e12,
        max_rel_err=err,
    )
    row["kernel_vs_copy"] = row["kernel_weight_TBps"] / copy
    if sweep:
        best: tuple[float, list[int] | None] = (math.inf, None)
        for cfg in sweep_configs(m):
            try:
                ms = timed(lambda i, c=cfg: decode_gemm(x, weights[i], None, c, counters[i]), len(weights), reps=10)
            except Exception as e:  # noqa: BLE001 - a tile the GPU cannot hold is a result of the sweep
                print(f"config {cfg}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
                continue
            if ms < best[0]:
                best = (ms, list(cfg))
        row["best_ms"], row["best_config"] = best
        row["best_weight_TBps"] = wbytes / (best[0] * 1e-3) / 1e12
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-0.6b")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    copy = device_copy_TBps()
    print(json.dumps({"copy_TBps": copy}), flush=True)
    shapes, layers = MODELS[args.model]
    rows = []
    for n, k in shapes:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        w = (torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)).to(torch.bfloat16)
        weights = [w] + [w.clone() for _ in range(1, max(2, COLD_BYTES // (w.numel() * 2)))]
        for m in args.m:
            x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
            rows.append(measure(x, weights, copy, args.sweep))
            print(json.dumps(rows[-1]), flush=True)
        del weights, w
        torch.cuda.empty_cache()
    step = []
    for m in args.m:
        mine = [r for r in rows if r["m"] == m]
        s = {"m": m, "layers": layers}
        for key in ("cublas_ms", "kernel_ms", "best_ms"):
            if all(key in r for r in mine):
                s[key.replace("_ms", "_step_ms")] = layers * sum(r[key] for r in mine)
        step.append(s)
        print(json.dumps(s), flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "decode-gemm.json"), "w") as f:
        json.dump(dict(model=args.model, rows=rows, step=step, copy_TBps=copy, **environment()), f, indent=1)


if __name__ == "__main__":
    main()
