"""Python garbage-collector pauses around an offline run (CPU, bundled model).

Times one full collection right after `LLM` start-up (what a generation-2 collection walks), then
counts the collections of each generation during a 256-request run and their total and longest
pause (`gc.callbacks`).

    python benchmarks/gc_pauses.py [--max-tokens 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pagedllm import LLM, SamplingParams, default_model_path  # noqa: E402
from pagedllm.bench.common import environment  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--out")
    args = ap.parse_args()
    llm = LLM(model=default_model_path(), kv_cache_memory_bytes=4 << 30, max_num_seqs=256)
    pauses = []
    for _ in range(5):
        t = time.perf_counter()
        gc.collect()
        pauses.append((time.perf_counter() - t) * 1e3)
    tracked = len(gc.get_objects())
    random.seed(0)
    prompts = [[random.randint(10, 8000) for _ in range(random.randint(100, 400))] for _ in range(256)]
    stats: list[tuple[int, float]] = []
    started = [0.0]

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            stats.append((info["generation"], (time.perf_counter() - started[0]) * 1e3))

    gc.callbacks.append(watch)
    t = time.time()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.6),
        use_tqdm=False,
    )
    wall = time.time() - t
    gc.callbacks.remove(watch)
    agg: dict[int, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for g, ms in stats:
        a = agg[g]
        a[0] += 1
        a[1] += ms
        a[2] = max(a[2], ms)
    row = dict(
        benchmark="gc_pauses",
        tracked_objects_after_startup=tracked,
        full_collection_after_startup_ms=sorted(pauses)[2],
        requests=len(prompts),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
        run_s=round(wall, 2),
        collections_during_run={
            str(g): dict(count=int(a[0]), total_ms=round(a[1], 1), longest_ms=round(a[2], 1))
            for g, a in sorted(agg.items())
        },
        **environment(),
    )
    print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
