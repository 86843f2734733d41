#!/usr/bin/env python3
"""Quantized weights on whole models: Qwen3-8B and Qwen3-32B shapes (random bytes made on the device,
load_format="dummy"), bf16 against FP8 per channel, FP8 block-wise and 4-bit (AWQ, GPTQ).

For each (shape, format), in a process of its own (so one engine's memory is gone before the next):
  - `weights_gib`: the weights' bytes on the device; `kv_blocks` and `capacity_4k`: how many
    concurrent 4,096-token sequences the KV pool holds at the default gpu_memory_utilization (what
    the smaller weights leave room for);
  - `tpot_ms_batch1`: one request, a 512-token prompt and `--tpot-tokens` new tokens, greedy: the
    mean time per output token after the first (weight-read bound: the bytes saved should show);
    `weight_read_tb_s`: the weights' bytes over that TPOT (a lower bound on the bandwidth used:
    the step reads the KV and does more than the GEMMs);
  - `tokens_per_s`: nano-vllm's standard workload (pagedllm/bench/throughput.py), `--num-seqs` of its
    256 requests.
The formats' config.json comes from tools/make_random_model.py --config-only --quantize; their
numbers mean nothing (random bytes), their speed is the format's. JSON rows on stdout and appended
to `--out`, with commit, GPU and versions.

    python benchmarks/quant_models.py --shapes qwen3-8b --formats bf16 fp8-channel fp8-block awq gptq --out rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
FORMATS = ("bf16", "fp8-channel", "fp8-block", "awq", "gptq")


def model_dir(shape: str, fmt: str, root: str) -> str:
    """config.json and the tokenizer for `shape` in `fmt`, written by tools/make_random_model.py."""
    import importlib.util

    out = os.path.join(root, f"{shape}-{fmt}")
    if not os.path.isdir(out):
        spec = importlib.util.spec_from_file_location("mrm", os.path.join(ROOT, "tools", "make_random_model.py"))
        assert spec is not None and spec.loader is not None
        tool = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)
        argv = ["--out", out, "--shape", shape, "--config-only"]
        tool.main(argv + ([] if fmt == "bf16" else ["--quantize", fmt]))
    return out


def measure(path: str, args, queue) -> None:
    """One engine's row into `queue` (or the error's last lines: the row says what failed)."""
    import traceback

    try:
        queue.put(_measure(path, args))
    except BaseException:
        queue.put({"error": traceback.format_exc()[-2000:]})
        raise


def _measure(path: str, args) -> dict:
    """One engine: its sizes, batch-1 TPOT and the standard workload's throughput."""
    import random

    from pagedllm import LLM, SamplingParams
    from pagedllm.bench.throughput import workload

    t0 = time.perf_counter()
    llm = LLM(path, load_format="dummy", max_model_len=4096, gpu_memory_utilization=args.gpu_memory_utilization)
    row: dict = {"startup_s": round(time.perf_counter() - t0, 1)}
    r = llm.runner
    row["weights_gib"] = round(r.weights_bytes / 2**30, 3)
    row["kv_blocks"] = r.num_kv_blocks
    row["capacity_4k"] = r.num_kv_blocks * r.block_size // 4096
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(1000, 10000) for _ in range(512)]}
    params = SamplingParams(temperature=0, max_tokens=args.tpot_tokens, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    tpots = []
    for _ in range(3):
        m = llm.generate([prompt], params, use_tqdm=False)[0].metrics
        assert m is not None and m.first_token_time is not None and m.finish_time is not None
        tpots.append((m.finish_time - m.first_token_time) / (args.tpot_tokens - 1))
    tpot = statistics.median(tpots)
    row["tpot_ms_batch1"] = round(1e3 * tpot, 3)
    row["weight_read_tb_s"] = round(r.weights_bytes / tpot / 1e12, 2)
    if args.num_seqs:
        prompts, plist = workload(args.num_seqs)
        t = time.perf_counter()
        outs = llm.generate(prompts, plist, use_tqdm=False)
        seconds = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row.update(output_tokens=tokens, seconds=round(seconds, 2), tokens_per_s=round(tokens / seconds, 1))
    llm.close()
    return row


def main(argv=None) -> None:
    from pagedllm.bench.common import environment

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["qwen3-8b"])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--num-seqs", type=int, default=256, help="standard workload requests (0: skip it)")
    p.add_argument("--tpot-tokens", type=int, default=128)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "pagedllm-quant-models"))
    p.add_argument("--out", help="append the rows here as JSON lines")
    args = p.parse_args(argv)
    env = environment()
    ctx = mp.get_context("spawn")
    for shape in args.shapes:
        for fmt in args.formats:
            path = model_dir(shape, fmt, args.dir)
            queue = ctx.Queue()
            proc = ctx.Process(target=measure, args=(path, args, queue))
            proc.start()
            proc.join()
            row = {"bench": "quant_models", "shape": shape, "format": fmt, "num_seqs": args.num_seqs}
            row.update(queue.get() if not queue.empty() else {"error": f"exit code {proc.exitcode}"})
            row.update(env)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
