"""The block-wise FP8 GEMM (ops/fp8_block_linear.py, 128x128 weight blocks) against bf16
`torch.matmul` at Qwen3-8B's linear shapes (N x K: o_proj 4096 x 4096, gate_up 12288 x 4096, down
4096 x 12288) for M = 1 .. 4096 tokens (CUDA only).

Per row: TFLOP/s (2 M N K / time) of the kernel alone (activations already quantized), of the whole
layer (`fp8_block_linear`: the per-token-group quantizer then the kernel), of bf16 `torch.matmul`, and
of `torch._scaled_mm` with row-wise scales (the per-channel FP8 path) for scale; `max_rel_err`: the
layer's largest difference from the float32 reference over the largest reference value. Timed with
`triton.testing.do_bench_cudagraph` (no launch overhead). JSON rows on stdout and in
$OUT/fp8-block-gemm.json (OUT default: .).

    python benchmarks/fp8_block_gemm.py [--sweep] [--m 1 16 256 2048]

--sweep also times a grid of tile configurations (BLOCK_M, BLOCK_N, GROUP_M, warps, stages) per
shape and M and reports the best beside the default (GEMM_CONFIGS)'s.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import platform
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import triton  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from pagedllm.bench.common import environment  # noqa: E402
from pagedllm.ops.fp8_block_linear import (  # noqa: E402
    fp8_block_gemm,
    fp8_block_linear,
    fp8_block_linear_ref,
    gemm_config,
    quantize_groups_triton,
)
from pagedllm.ops.fp8_linear import quantize_rows, quantize_weight  # noqa: E402

SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288)]
BLOCK = (128, 128)


def quantize_blocks():
    """tools/quantize_checkpoint.py's block quantizer (the test checkpoints' own)."""
    spec = importlib.util.spec_from_file_location(
        "quantize_checkpoint", os.path.join(ROOT, "tools/quantize_checkpoint.py")
    )
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.quantize_blocks


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2 * m * n * k / (ms * 1e-3) / 1e12


def sweep_configs(m: int):
    """The tile grid for M rows: no row tile past the next power of two of M (at least 16)."""
    top = max(16, triton.next_power_of_2(m))
    for bm, bn, gm, w, s in itertools.product((16, 32, 64, 128), (32, 64, 128), (1, 8), (4, 8), (3, 4)):
        if bm <= top:
            yield (bm, bn, gm, w, s)


def time_config(m, n, k, xq, xs, wq, ws, config) -> float:
    """TFLOP/s of the kernel with one tile configuration; 0 for one that does not compile or run
    (e.g. more shared memory than the GPU has)."""
    try:
        return tflops(m, n, k, do_bench_cudagraph(lambda: fp8_block_gemm(xq, xs, wq, ws, BLOCK, config=config)))
    except Exception as e:  # noqa: BLE001 - a tile the GPU cannot hold is a result of the sweep, not an error
        print(f"config {config}: {type(e).__name__}", file=sys.stderr)
        return 0.0


def measure(x, w, wq, ws, wq_rows, ws_rows, sweep: bool) -> dict:
    """One row: x [M, K] bf16 against W [N, K] (bf16), its 128x128-block and its per-channel fp8 forms."""
    (m, k), n = x.shape, w.shape[0]
    xq, xs = quantize_groups_triton(x, BLOCK[1])
    xq_rows, xs_rows = quantize_rows(x)
    want = fp8_block_linear_ref(x.float(), wq, ws, BLOCK)
    err = float((fp8_block_linear(x, wq, ws, BLOCK).float() - want).abs().max() / want.abs().max())

    def scaled_mm():
        return torch._scaled_mm(
            xq_rows, wq_rows.t(), scale_a=xs_rows, scale_b=ws_rows.view(1, -1), out_dtype=torch.bfloat16
        )

    row = dict(
        m=m,
        n=n,
        k=k,
        block=list(BLOCK),
        config=list(gemm_config(m)),
        gemm_tflops=tflops(m, n, k, do_bench_cudagraph(lambda: fp8_block_gemm(xq, xs, wq, ws, BLOCK))),
        layer_tflops=tflops(m, n, k, do_bench_cudagraph(lambda: fp8_block_linear(x, wq, ws, BLOCK))),
        bf16_matmul_tflops=tflops(m, n, k, do_bench_cudagraph(lambda: torch.matmul(x, w.t()))),
        rowwise_scaled_mm_tflops=tflops(m, n, k, do_bench_cudagraph(scaled_mm)),
        max_rel_err=err,
    )
    row["gemm_vs_bf16"] = row["gemm_tflops"] / row["bf16_matmul_tflops"]
    if sweep:
        best = max((time_config(m, n, k, xq, xs, wq, ws, c), c) for c in sweep_configs(m))
        row["best_tflops"], row["best_config"] = best[0], list(best[1])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 2048, 4096])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    quantize = quantize_blocks()
    rows = []
    for n, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        wq, ws = quantize(w, BLOCK)
        wq_rows, ws_rows = quantize_weight(w)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
            rows.append(measure(x, w, wq, ws, wq_rows, ws_rows, args.sweep))
            print(json.dumps(rows[-1]), flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "fp8-block-gemm.json"), "w") as f:
        json.dump(
            dict(
                rows=rows,
                python=platform.python_version(),
                **environment(),  # commit, GPU, torch, triton, transformers, date
            ),
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
