"""The decode step's floor (CUDA only): a captured decode graph replayed at batch B x context C,
against the bytes it must read (weights + KV) at the device's copy bandwidth.

For each batch: the graph's replay time (CUDA events over many replays, so host time is not
in it), the kernels one replay launches and the GPU time by kernel (torch.profiler over replays),
and the floor: (weight bytes + B * C * KV bytes per token) / copy bandwidth. Then the whole
engine at batch 1: one request of C prompt tokens generating N tokens through `LLMEngine.step`,
the median wall time per decode step (host and device, as a user sees it).

    python benchmarks/decode_step.py --model /tmp/qwen3-0.6b --context 1024 --out decode.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.bench.common import device_copy_TBps, environment  # noqa: E402


def fill(graphs, bs: int, ctx: int, block_size: int) -> None:
    """Static inputs of a decode step: row i at position ctx - 1 over its own ctx / block_size blocks."""
    nb = -(-ctx // block_size)
    graphs.input_ids[:bs] = 1
    graphs.positions[:bs] = ctx - 1
    graphs.seq_lens[:bs] = ctx
    tables = torch.arange(bs * nb, dtype=torch.int32, device="cuda").view(bs, nb)
    graphs.block_tables[:bs, :nb] = tables
    graphs.slot_mapping[:bs] = tables[:, -1].long() * block_size + (ctx - 1) % block_size


def replay_ms(g, n: int = 200) -> float:
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def kernel_profile(g, n: int = 20) -> tuple[int, list[dict]]:
    """(kernels per replay, GPU time by kernel name per replay, largest first)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            g.replay()
        torch.cuda.synchronize()
    count, by_name = 0, defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")):
            count += 1
            by_name[e.name][0] += 1
            by_name[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    rows = [
        {"kernel": k[:90], "per_step": c / n, "us_per_step": round(t / n, 2)}
        for k, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])
    ]
    return round(count / n), rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", default="1,2,4,8,16,64,256")
    ap.add_argument("--engine-tokens", type=int, default=256, help="tokens generated in the batch-1 engine run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--host-profile", default=None, help="write a cProfile of the batch-1 engine run's steps here")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ctx = args.context
    llm = LLM(args.model, device="cuda", max_num_seqs=max(batches), max_model_len=ctx + args.engine_tokens + 16,
              num_kv_blocks=max(batches) * (-(-(ctx + args.engine_tokens + 16) // 16)) + 64)  # fmt: skip
    runner = llm.engine.core.executor
    graphs = runner.graphs
    assert graphs is not None, "needs CUDA graphs (not --enforce-eager)"
    a = runner.attn_layers[0]
    kv_per_token = len(runner.attn_layers) * 2 * a.num_kv_heads * a.head_dim * runner.kv_cache[0].element_size()
    weights = runner.weights_bytes
    bw = device_copy_TBps()
    rows = []
    for bs in batches:
        padded = min(s for s in graphs.sizes if s >= bs)
        fill(graphs, padded, ctx, runner.block_size)
        g = graphs.graphs[padded]
        ms = replay_ms(g)
        floor_ms = (weights + bs * ctx * kv_per_token) / (bw * 1e12) * 1000
        n_kernels, top = kernel_profile(g) if bs in (1, 64, 256) else (None, [])
        row = {"batch": bs, "graph": padded, "replay_ms": round(ms, 4), "floor_ms": round(floor_ms, 4),
               "floor_fraction": round(floor_ms / ms, 3), "kernels_per_step": n_kernels, "top_kernels": top[:25]}  # fmt: skip
        print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
        rows.append(row)
    # the whole engine at batch 1: wall time per decode step, host included
    e = llm.engine
    prompt = [(7 * i) % 1000 + 10 for i in range(ctx)]
    params = SamplingParams(temperature=0, max_tokens=args.engine_tokens, ignore_eos=True)
    steps = []
    prof = cProfile.Profile() if args.host_profile else None
    for rep in range(2):
        e.add_request(f"b1-{rep}", prompt, params)
        while e.has_unfinished_requests():
            if prof is not None and rep == 1:
                prof.enable()
            t = time.perf_counter()
            e.step()
            steps.append(time.perf_counter() - t)
            if prof is not None:
                prof.disable()
    if prof is not None:
        text = io.StringIO()
        text.write("host time of the second batch-1 engine run's steps (cProfile: steps are slower under it)\n")
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=text).sort_stats(key).print_stats(45)
        with open(args.host_profile, "w") as f:
            f.write(text.getvalue())
    decode = steps[len(steps) // 2 + 8 :]  # the second run's steady decode steps
    engine = {"median_step_ms": round(statistics.median(decode) * 1000, 4), "steps": len(decode)}
    print("engine batch 1:", engine, flush=True)
    out = {
        "benchmark": "decode_step",
        "label": args.label,
        "context": ctx,
        "weights_bytes": weights,
        "kv_bytes_per_token": kv_per_token,
        "copy_TBps": round(bw, 3),
        "rows": rows,
        "engine_batch1": engine,
        **environment(),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
