#!/usr/bin/env python3
"""Sliding-window KV over a long decode: the blocks each KV-cache group holds as one sequence
grows to --context tokens, read from the engine's metrics (get_metrics()["kv_cache_groups"],
what /metrics exports as pagedllm:kv_cache_group_blocks).

A model with sliding-window layers (e.g. tools/make_random_model.py --shape gemma3-1b: 22 layers
with a 512-token window, 4 global) gets one block table per group; a window's group gives back
the blocks that leave its window, so its blocks stay bounded while a full-attention group's grow
with the sequence. One request of --prompt-len random token ids decodes greedily, ignore_eos, up to
--context tokens. Every --every steps the row records the context length, the blocks per group and
the time per decode step since the previous sample; at the end it also records what the same
sequence would hold with every layer in one full-attention group (layer-blocks), for comparison.

    python benchmarks/sliding_window.py --model /tmp/gemma3-1b --context 32768
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from pagedllm.bench.common import environment, save_results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--context", type=int, default=32768, help="tokens the sequence grows to")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--every", type=int, default=512, help="decode steps between samples")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--results-dir", default="benchmarks/results")
    p.add_argument("--out", default=None)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)

    from pagedllm import LLM, SamplingParams

    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        max_model_len=args.context,
        max_num_seqs=4,
        max_num_batched_tokens=2048,
    )
    engine = llm.engine
    groups = engine.kv.groups
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, llm.tokenizer.vocab_size, size=args.prompt_len).tolist()
    new = args.context - args.prompt_len
    engine.add_request("long", prompt, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    samples = []
    steps, t_last, seq_len = 0, time.perf_counter(), args.prompt_len
    most = [0] * len(groups)
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        m = engine.get_metrics()
        blocks = [g["num_blocks"] for g in m["kv_cache_groups"]]
        most = [max(a, b) for a, b in zip(most, blocks, strict=True)]
        for o in outs:
            seq_len = args.prompt_len + len(o.outputs[0].token_ids)
        if steps % args.every == 0:
            now = time.perf_counter()
            samples.append(
                {
                    "step": steps,
                    "context": seq_len,
                    "blocks_by_group": blocks,
                    "kv_cache_usage": round(m["kv_cache_usage"], 5),
                    "ms_per_step": round((now - t_last) * 1e3 / args.every, 3),
                }
            )
            t_last = now
            print(samples[-1], file=sys.stderr)
    layers = sum(len(g.layer_ids) for g in groups)
    slots = max(len(g.layer_ids) for g in groups)
    full_blocks = -(-(args.context - 1) // args.block_size)
    row = {
        **environment(),
        "benchmark": "sliding_window_decode",
        "model": args.model,
        "groups": [
            {"kind": g.kind, "sliding_window": g.sliding_window, "num_layers": len(g.layer_ids)} for g in groups
        ],
        "block_size": args.block_size,
        "prompt_len": args.prompt_len,
        "context": args.context,
        "num_kv_blocks": engine.kv.num_blocks,
        "max_blocks_by_group": most,
        # layer-blocks (one block of one layer) at the peak, against one full-attention group of all layers
        "peak_layer_blocks": sum(most) * slots,
        "one_group_layer_blocks": full_blocks * layers,
        "samples": samples,
        "free_equals_total_at_end": engine.kv.num_free_blocks == engine.kv.num_blocks,
    }
    print({k: v for k, v in row.items() if k != "samples"}, file=sys.stderr)
    save_results(row, args, "sliding-window-decode")
    return 0


if __name__ == "__main__":
    sys.exit(main())
