"""The fused MoE kernels with quantized experts against the bf16 one (CUDA only): decode (1..256 tokens)
and prefill (8192 tokens) at Qwen3-30B-A3B's and Mixtral-8x7B's expert shapes, random routing.

Variants: bf16 (ops/fused_moe.py), fp8-block (128x128 block scales, activations per token group),
fp8-row (one scale per output row, activations per token; what quantization="fp8" makes), int4 (group
128, AWQ/GPTQ's packed layout; ops/fused_moe_int4.py). Each case reports the kernel's time replayed in a
CUDA graph (as decode runs it), the bytes of the experts the routing touches per second (TB/s), TFLOP/s
(6 * H * I per (token, expert) pair), and the kernel's relative error against its torch reference.

    python benchmarks/moe_quant.py [--shape qwen3-30b-a3b|mixtral-8x7b|all] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from triton.testing import do_bench_cudagraph  # noqa: E402

from pagedllm.bench.common import environment  # noqa: E402
from pagedllm.ops.fp8_linear import FP8  # noqa: E402
from pagedllm.ops.fused_moe import fused_moe  # noqa: E402
from pagedllm.ops.fused_moe_quant import fused_moe_quant  # noqa: E402
from pagedllm.ops.moe_quant import Fp8Stack, Int4Stack, quant_moe_ref  # noqa: E402
from pagedllm.ops.moe_ref import fused_moe_ref, select_experts  # noqa: E402

SHAPES = {  # experts, hidden, expert intermediate, top-k
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}
M = [1, 4, 16, 64, 256, 8192]
VARIANTS = ("bf16", "fp8-block", "fp8-row", "int4")
DEVICE = "cuda"


def weights(variant: str, e: int, n: int, k: int, seed: int):
    """One stack of E matrices [N, K] in the variant's layout, and its bytes per expert."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    if variant == "bf16":
        w = torch.randn(e, n, k, device=DEVICE, dtype=torch.bfloat16, generator=g) / k**0.5
        return w, n * k * 2
    if variant.startswith("fp8"):
        q = torch.empty(e, n, k, device=DEVICE).normal_(0, 64, generator=g).clamp_(-448, 448).to(FP8)
        block = (128, 128) if variant == "fp8-block" else None
        shape = (e, n) if block is None else (e, n // 128, k // 128)
        scale = torch.rand(shape, device=DEVICE, generator=g) / (64 * k**0.5) + 1e-5
        return Fp8Stack(q, scale, block), n * k + scale[0].numel() * 4
    words = torch.randint(-(2**31), 2**31 - 1, (e, k // 8, n), device=DEVICE, dtype=torch.int32, generator=g)
    scales = ((torch.rand(e, k // 128, n, device=DEVICE, generator=g) + 0.5) / (8 * k**0.5)).half()
    zeros = torch.randint(0, 16, (e, k // 128, n), device=DEVICE, generator=g).to(torch.uint8)
    return Int4Stack(words, scales, zeros, None, 128), n * k // 2 + (k // 128) * n * 3


def case(shape: str, variant: str, m: int, w13, w2, bytes_per_expert: int) -> dict:
    e, h, i, k = SHAPES[shape]
    g = torch.Generator(device=DEVICE).manual_seed(m)
    x = torch.randn(m, h, device=DEVICE, dtype=torch.bfloat16, generator=g)
    wt, ids = select_experts(torch.randn(m, e, device=DEVICE, generator=g), k, renormalize=True)
    kernel, ref = (fused_moe, fused_moe_ref) if variant == "bf16" else (fused_moe_quant, quant_moe_ref)
    out = kernel(x, w13, w2, wt, ids)
    want = ref(x, w13, w2, wt, ids).float()
    err = float((out.float() - want).abs().max() / want.abs().max())
    ms = do_bench_cudagraph(lambda: kernel(x, w13, w2, wt, ids), rep=100)
    touched = int(torch.unique(ids).numel())
    return dict(
        shape=shape,
        variant=variant,
        M=m,
        experts_touched=touched,
        ms=round(ms, 4),
        weight_TBps=round(touched * bytes_per_expert / ms / 1e9, 3),
        TFLOPs=round(6 * m * k * h * i / ms / 1e9, 1),
        rel_err_vs_ref=round(err, 5),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for shape in SHAPES if args.shape == "all" else [args.shape]:
        e, h, i, _ = SHAPES[shape]
        for variant in VARIANTS:
            (w13, b13), (w2, b2) = weights(variant, e, 2 * i, h, 1), weights(variant, e, h, i, 2)
            for m in M:
                row = case(shape, variant, m, w13, w2, b13 + b2)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del w13, w2
            torch.cuda.empty_cache()
    result = dict(environment=environment(), rows=rows)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
