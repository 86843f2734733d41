"""The 4-bit weight-only GEMM (ops/int4_linear.py, group 128, asymmetric zeros) against bf16 `torch.matmul`
of the same weight dequantized, at Qwen3-8B's linear shapes (N x K: o_proj 4096 x 4096, gate_up
12288 x 4096, down 4096 x 12288) for M = 1 .. 4096 tokens (CUDA only).

Per row: the kernel's and the bf16 matmul's time; for M <= 16 (decode: reading the weight is the
work) the TB/s of weight bytes read (4-bit: packed words + scales + zeros; bf16: 2 bytes a weight)
and its fraction of the device copy bandwidth (a 1 GiB device-to-device copy, bytes read plus written);
for larger M, TFLOP/s (2 M N K / time). `max_rel_err`: the kernel's largest difference from the float32
reference over the largest reference value. Timed with `triton.testing.do_bench_cudagraph` (no launch
overhead) over enough copies of the weight, called one after another, that they do not fit in L2 (as
a decode step's layers do not): the time per call is the graph's over the copies. JSON rows on stdout
and in $OUT/int4-gemm.json (OUT default: .).

    python benchmarks/int4_gemm.py [--sweep] [--m 1 16 256 2048] [--desc-act]

--sweep also times a grid of tile configurations (BLOCK_M, BLOCK_N, largest BLOCK_K, GROUP_M, warps,
stages) and K splits per shape and M, and reports the best beside the default (GEMM_CONFIGS, split_k).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import triton  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from pagedllm.bench.common import device_copy_TBps, environment  # noqa: E402
from pagedllm.ops._triton import num_sms  # noqa: E402
from pagedllm.ops.int4_linear import (  # noqa: E402
    block_k_tile,
    dequantize,
    gemm_config,
    int4_gemm,
    int4_linear_ref,
    pack_k,
    split_k,
)

SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288)]
GROUP = 128
COLD_BYTES = 256 * 1024**2  # the weight copies a timed call walks through: several times an H200's 50 MB L2


def packed_weight(n: int, k: int, g: torch.Generator, desc_act: bool):
    """(qweight, scales, zeros, perm) of a random 4-bit W [N, K]: what a checkpoint's layer becomes."""
    q = torch.randint(0, 16, (k, n), device="cuda", generator=g)
    scales = (0.001 + 0.01 * torch.rand(k // GROUP, n, device="cuda", generator=g)).half()
    zeros = torch.randint(0, 16, (k // GROUP, n), device="cuda", generator=g).to(torch.uint8)
    perm = torch.randperm(k, device="cuda", generator=g).to(torch.int32) if desc_act else None
    return pack_k(q), scales, zeros, perm


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def timed(fn_of, copies: int) -> float:
    """ms per call of fn_of(i) over copies i = 0 .. copies - 1, one after another in one graph."""
    return do_bench_cudagraph(lambda: [fn_of(i) for i in range(copies)], rep=100) / copies


def sweep_configs(m: int):
    """The tile grid for M rows: decode (M <= 64) one row tile, column tiles x K tiles x K splits; prefill
    row and column tiles x K tiles x warps x stages, no split."""
    if m <= 64:
        bm = max(16, triton.next_power_of_2(m))
        for bn, bk, split in itertools.product((32, 64, 128), (64, 128), (1, 2, 4, 8, 16)):
            yield (bm, bn, bk, 1, 4, 3), split
        return
    for bm, bn, bk, w, s in itertools.product((64, 128), (64, 128), (32, 64), (4, 8), (3, 4)):
        yield (bm, bn, bk, 8, w, s), 1


def measure(x, weights, w_bf16, copy: float, sweep: bool) -> dict:
    """One row: x [M, K] bf16 against the packed weights (copies of one shape) and their bf16 form."""
    (m, k), n = x.shape, weights[0][0].shape[1]
    qw, s, z, perm = weights[0]
    want = int4_linear_ref(x.float(), qw, s, z, GROUP, perm)
    err = float((int4_gemm(x, qw, s, z, GROUP, perm).float() - want).abs().max() / want.abs().max())
    int4_ms = timed(lambda i: int4_gemm(x, *weights[i][:3], GROUP, weights[i][3]), len(weights))
    bf16_ms = timed(lambda i: torch.matmul(x, w_bf16[i].t()), len(w_bf16))
    block_m, block_n, largest_k = gemm_config(m)[:3]
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    row = dict(
        m=m,
        n=n,
        k=k,
        group=GROUP,
        desc_act=perm is not None,
        config=list(gemm_config(m)),
        split_k=split_k(tiles, k // block_k_tile(GROUP, largest_k), num_sms(x.device)),
        int4_ms=int4_ms,
        bf16_matmul_ms=bf16_ms,
        speedup_vs_bf16=bf16_ms / int4_ms,
        max_rel_err=err,
    )
    if m <= 16:
        row["int4_weight_TBps"] = nbytes(qw, s, z, perm) / (int4_ms * 1e-3) / 1e12
        row["bf16_weight_TBps"] = n * k * 2 / (bf16_ms * 1e-3) / 1e12
        row["int4_vs_copy"] = row["int4_weight_TBps"] / copy
    else:
        row["int4_tflops"] = 2 * m * n * k / (int4_ms * 1e-3) / 1e12
        row["bf16_matmul_tflops"] = 2 * m * n * k / (bf16_ms * 1e-3) / 1e12
    if sweep:
        best = (math.inf, None)
        for config, split in sweep_configs(m):
            try:
                ms = timed(
                    lambda i, c=config, sp=split: int4_gemm(x, *weights[i][:3], GROUP, weights[i][3], None, c, sp),
                    len(weights),
                )
            except Exception as e:  # noqa: BLE001 - a tile the GPU cannot hold is a result of the sweep, not an error
                print(f"config {config} split {split}: {type(e).__name__}", file=sys.stderr)
                continue
            best = min(best, (ms, (list(config), split)), key=lambda b: b[0])
        row["best_ms"], row["best_config"] = best
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 2048, 4096])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--desc-act", action="store_true", help="GPTQ desc_act: the kernel gathers x through perm")
    args = ap.parse_args()
    copy = device_copy_TBps()  # eager: a copy captured in a graph reads ~2.8 TB/s, not ~4.3
    print(json.dumps({"copy_TBps": copy}), flush=True)
    rows = []
    for n, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        one = packed_weight(n, k, g, args.desc_act)
        weights = [one] + [
            tuple(t.clone() if t is not None else None for t in one)
            for _ in range(1, max(1, COLD_BYTES // nbytes(*one)))
        ]
        w = dequantize(*one[:3], GROUP).t().to(torch.bfloat16).contiguous()  # [N, K], in the packed row order
        w_bf16 = [w] + [w.clone() for _ in range(1, max(1, COLD_BYTES // nbytes(w)))]
        for m in args.m:
            x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
            rows.append(measure(x, weights, w_bf16, copy, args.sweep))
            print(json.dumps(rows[-1]), flush=True)
        del weights, w_bf16
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "int4-gemm.json"), "w") as f:
        json.dump(
            dict(
                rows=rows,
                copy_TBps=copy,
                python=platform.python_version(),
                **environment(),  # commit, GPU, torch, triton, transformers, date
            ),
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
