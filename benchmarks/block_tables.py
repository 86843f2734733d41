#!/usr/bin/env python3
"""Host cost of one decode step's block tables, per KV-cache group count, without a model.

An engine with an executor that samples at once runs 256 requests of 1,024 random prompt tokens
for 60 steps, so every sequence decodes with 65-68 blocks per table; then the last step's
SchedulerOutput is turned into (slot_mapping, block_tables) for every group three ways:
  per_row_lists - each group's table row by row from the Python lists (what step_inputs did
                  before BlockTableRows);
  flat_fromiter - every table of every sequence in one np.fromiter pass (tried and dropped);
  kept_rows     - BlockTableRows, warm (worker/step_inputs.py: the arrays kept across steps).
For Qwen3-0.6B's layout (28 full-attention layers: one group) and Gemma-3-1B's (26 layers,
22 windowed: seven groups). Best of 5 repeats of 20 calls each; all three must agree.

    python benchmarks/block_tables.py --results-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import random
import sys
import timeit
from itertools import chain

import numpy as np

from pagedllm.bench.common import environment, save_results
from pagedllm.engine import LLMEngine, SamplingParams, SchedulerConfig
from pagedllm.engine.executor import StepResult
from pagedllm.engine.kv_cache_groups import KVCacheGroup, kv_cache_groups
from pagedllm.worker.step_inputs import BlockTableRows

BLOCK_SIZE = 16
LAYOUTS = {
    "qwen3-0.6b (1 group)": [None] * 28,
    "gemma3-1b (7 groups)": [512 if (i + 1) % 6 else None for i in range(26)],
}


class CapturingExecutor:
    """An Executor that samples at once and keeps the last SchedulerOutput."""

    num_kv_blocks = 200_000
    supports_async = False
    kv_cache_dtype = "bfloat16"

    def __init__(self, groups: tuple[KVCacheGroup, ...]) -> None:
        self.kv_cache_groups = groups
        self.rng = random.Random(0)
        self.last = None

    def execute(self, out):
        self.last = out
        return StepResult([self.rng.randrange(100, 8000) for s in out.scheduled if s.samples])

    def execute_async(self, out):
        raise NotImplementedError

    def close(self) -> None:
        pass


def per_row_lists(sched, num_groups, positions, seq_of_token):
    out = []
    for g in range(num_groups):
        tables = np.zeros((len(sched), max(len(s.seq.block_tables[g]) for s in sched)), dtype=np.int32)
        for i, s in enumerate(sched):
            bt = s.seq.block_tables[g]
            tables[i, : len(bt)] = bt
        np.maximum(tables, 0, out=tables)
        slots = tables[seq_of_token, positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
        out.append((slots, tables))
    return out


def flat_fromiter(sched, num_groups, positions, seq_of_token):
    lens = np.fromiter((len(s.seq.block_tables[0]) for s in sched), dtype=np.int64, count=len(sched))
    flat = np.fromiter(chain.from_iterable(chain.from_iterable(s.seq.block_tables) for s in sched), dtype=np.int32)
    tables = np.zeros((len(sched), num_groups, int(lens.max())), dtype=np.int32)
    filled = np.arange(tables.shape[2]) < lens[:, None]
    tables[np.broadcast_to(filled[:, None, :], tables.shape)] = flat
    np.maximum(tables, 0, out=tables)
    slots = tables[seq_of_token, :, positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
    slots += (positions % BLOCK_SIZE)[:, None]
    return [(np.ascontiguousarray(slots[:, g]), np.ascontiguousarray(tables[:, g])) for g in range(num_groups)]


def kept_rows(rows: BlockTableRows):
    def build(sched, num_groups, positions, seq_of_token):
        tables = rows.tables(sched, num_groups)
        slots = tables[:, seq_of_token, positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
        slots += positions % BLOCK_SIZE
        return [(slots[g], tables[g]) for g in range(num_groups)]

    return build


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", default="benchmarks/results")
    p.add_argument("--out", default=None)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    results = {}
    for name, windows in LAYOUTS.items():
        groups = kv_cache_groups(windows)
        ex = CapturingExecutor(groups)
        cfg = SchedulerConfig(
            num_kv_blocks=ex.num_kv_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=8192, max_model_len=4096
        )
        engine = LLMEngine(cfg, ex)
        rng = random.Random(0)
        for i in range(256):
            prompt = [rng.randrange(100, 8000) for _ in range(1024)]
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=128, ignore_eos=True))
        for _ in range(60):
            engine.step()
        sched = ex.last.scheduled
        positions = np.fromiter((s.seq.num_computed_tokens for s in sched), dtype=np.int64, count=len(sched))
        seq_of_token = np.arange(len(sched))
        ways = {
            "per_row_lists": per_row_lists,
            "flat_fromiter": flat_fromiter,
            "kept_rows": kept_rows(BlockTableRows()),
        }
        built = {k: f(sched, len(groups), positions, seq_of_token) for k, f in ways.items()}  # warms kept_rows
        want = built["per_row_lists"]
        for k, b in built.items():
            assert all(
                np.array_equal(x, y) for pa, pb in zip(b, want, strict=True) for x, y in zip(pa, pb, strict=True)
            ), k
        row = {"batch": len(sched), "groups": len(groups), "max_blocks": int(built["kept_rows"][0][1].shape[1])}
        call = (sched, len(groups), positions, seq_of_token)
        for k, f in ways.items():
            t = min(timeit.repeat(lambda f=f, call=call: f(*call), number=20, repeat=5))
            row[f"{k}_ms"] = round(t / 20 * 1e3, 3)
        results[name] = row
        print(name, row, file=sys.stderr)
    save_results({**environment(), "benchmark": "block_tables_host", "layouts": results}, args, "block-tables-cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
