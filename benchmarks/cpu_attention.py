"""CPU paged attention (TorchKernels.attend) with short and long sequences in one batch.

One call is one layer's attention of one engine step, K/V already stored, float32, block
size 16, block tables shuffled over the pool (as after some traffic). Cases, per head shape:
- `short32`: a decode step of 32 sequences of context 48..80 (seeded, about 64);
- `long1`: a decode step of one sequence of context 1,888;
- `mixed`: both in one decode step (33 sequences);
- `short1`, `short4`: small decode batches of context ~64 (they must not get slower);
- `chunk`: a prefill chunk of 64 new tokens over a cached prefix of 1,824 (context 1,888);
- `mixed_chunk`: `short32`'s decodes and that chunk in one step (the general varlen path).
Head shapes: the bundled default model's (6 q heads, 2 KV heads, head dim 64) and a
Qwen3-0.6B-like one (16 q heads, 8 KV heads, head dim 128). Then whole `LLM.generate` calls
of the bundled model with the same three workloads (`engine_runs`; `--engine-tokens 0` skips).

Prediction (written before the fix): attention that pads every sequence to the longest
context costs `mixed` about 33/1 `long1` (the 32 short rows do 1,888 positions of work each),
5-9x `short32`; gathered by block table without padding, `mixed` should cost about
`short32` + `long1`, and `mixed_chunk` about `short32` + `chunk`; the same for whole
`LLM.generate` calls (`mixed` about `short32` + `long1`, where it was 5-9x `short32`).

Each case is timed as the median of `--iters` calls after a warm-up, the cases called in turn
(round robin); that is repeated `--repeats` times and the median of the runs is recorded (the
machine may be shared: medians, not minima; one torch thread by default, since on a loaded
box a second thread makes every op wait for a core). Runs against whatever `pagedllm` is
importable, so an older tree is measured with the same script:

    PAGEDLLM_COMMIT=80605b1 PYTHONPATH=/tmp/base python benchmarks/cpu_attention.py --label before
    python benchmarks/cpu_attention.py --label after

`--budget-sweep` instead times the grouped decode at several pad budgets (`budget_sweep`).
Rows are appended to benchmarks/results/cpu-attention.json (a JSON list).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

BLOCK_SIZE = 16
SHAPES = {"default_model": (6, 2, 64), "qwen3_0.6b": (16, 8, 128)}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def make_case(shape: tuple[int, int, int], q_lens: list[int], seq_lens: list[int], seed: int = 0):
    """(q, k_cache, v_cache, AttentionMetadata) of one step; K/V of every position already stored."""
    from pagedllm.ops.attention_metadata import AttentionMetadata

    hq, hkv, d = shape
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    k_cache = torch.randn(num_blocks, hkv, BLOCK_SIZE, d, generator=g)
    v_cache = torch.randn(num_blocks, hkv, BLOCK_SIZE, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    at = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = perm[at : at + nb]
        at += nb
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    total = int(cu[-1])
    q = torch.randn(total, hq, d, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.full((total,), -1, dtype=torch.int64),
        block_tables=tables,
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seq_lens),
        decode_only=all(n == 1 for n in q_lens),
        no_history=False,
    )
    return q, k_cache, v_cache, meta


def cases(shape: tuple[int, int, int]) -> dict[str, tuple]:
    g = torch.Generator().manual_seed(1)
    short = torch.randint(48, 81, (32,), generator=g).tolist()
    long_ctx, chunk = 1888, 64
    return {
        "short1": make_case(shape, [1], short[:1]),
        "short4": make_case(shape, [1] * 4, short[:4]),
        "short32": make_case(shape, [1] * 32, short),
        "long1": make_case(shape, [1], [long_ctx]),
        "mixed": make_case(shape, [1] * 33, short + [long_ctx]),
        "chunk": make_case(shape, [chunk], [long_ctx]),
        "mixed_chunk": make_case(shape, [1] * 32 + [chunk], short + [long_ctx]),
    }


def time_round_robin(calls: dict[str, Callable[[], object]], iters: int) -> dict[str, float]:
    """Median ms of one call of each case, the cases called in turn so that a shared machine's
    load falls on all of them alike; after a warm-up of 3 calls each."""
    for fn in calls.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {c: [] for c in calls}
    for _ in range(iters):
        for c, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[c].append(time.perf_counter() - start)
    return {c: statistics.median(t) * 1e3 for c, t in times.items()}


SWEEP_BUDGETS = [1 << 16, 1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 40]  # 2^40: one group, padded to the longest


def budget_sweep(shape: tuple[int, int, int], iters: int, repeats: int) -> dict[str, dict]:
    """`paged_decode_attention_grouped` at each pad budget of SWEEP_BUDGETS, on decode batches of
    similar lengths (`short32`), two far apart (`mixed`), two near (16 x 256 and 16 x 512) and a
    spread (32 contexts uniform in 64..1024): ms (median of runs) and the number of groups."""
    from pagedllm.ops.attention_ref import decode_groups, paged_decode_attention_grouped

    g = torch.Generator().manual_seed(3)
    built = {c: v for c, v in cases(shape).items() if c in ("short32", "mixed")}
    built["two_lens"] = make_case(shape, [1] * 32, [256] * 16 + [512] * 16)
    built["spread32"] = make_case(shape, [1] * 32, torch.randint(64, 1025, (32,), generator=g).tolist())
    out: dict[str, dict] = {}
    block_elems = 2 * shape[1] * BLOCK_SIZE * shape[2]
    for c, (q, kc, vc, m) in built.items():
        calls = {
            f"2^{b.bit_length() - 1}": partial(
                paged_decode_attention_grouped, q, kc, vc, m.block_tables, m.seq_lens, 0.1, b
            )
            for b in SWEEP_BUDGETS
        }
        runs: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(repeats):
            for k, ms in time_round_robin(calls, iters).items():
                runs[k].append(ms)
        lens = m.seq_lens.tolist()
        out[c] = {
            k: {
                "ms": round(statistics.median(r), 3),
                "groups": len(decode_groups(lens, BLOCK_SIZE, max(1, b // block_elems))),
            }
            for (k, r), b in zip(runs.items(), SWEEP_BUDGETS, strict=True)
        }
        print(c, {k: (v["ms"], v["groups"]) for k, v in out[c].items()}, flush=True)
    return out


def engine_runs(repeats: int, max_tokens: int) -> dict[str, object]:
    """Whole `LLM.generate` calls of the bundled model (float32, CPU, no prefix caching so that
    repeats recompute): 32 prompts of 48..80 random tokens, one of 1,888, and both together;
    `max_tokens` greedy tokens each. Seconds per call, median of `repeats` (alternating)."""
    import pagedllm
    from pagedllm import LLM, SamplingParams

    llm = LLM(pagedllm.default_model_path(), dtype="float32", device="cpu", enable_prefix_caching=False)
    g = torch.Generator().manual_seed(2)
    short = [
        torch.randint(100, 8000, (int(n),), generator=g).tolist() for n in torch.randint(48, 81, (32,), generator=g)
    ]
    long = [torch.randint(100, 8000, (1888,), generator=g).tolist()]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    workloads = {"short32": short, "long1": long, "mixed": short + long}
    runs: dict[str, list[float]] = {w: [] for w in workloads}
    llm.generate([{"prompt_token_ids": ids} for ids in short[:4]], params, use_tqdm=False)  # warm-up
    for _ in range(repeats):
        for w, prompts in workloads.items():
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
            runs[w].append(time.perf_counter() - start)
    med = {w: round(statistics.median(r), 3) for w, r in runs.items()}
    return {
        "max_tokens": max_tokens,
        "median_s": med,
        "runs_s": {w: [round(x, 3) for x in r] for w, r in runs.items()},
        "mixed_over_short32": round(med["mixed"] / med["short32"], 2),
        "mixed_over_short32_plus_long1": round(med["mixed"] / (med["short32"] + med["long1"]), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=20, help="calls per case and run; the median is taken")
    p.add_argument("--repeats", type=int, default=5, help="runs of every case; the median is recorded")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (0: torch's default); on a shared box more threads than free cores wait at every op",
    )
    p.add_argument("--engine-tokens", type=int, default=32, help="new tokens per request of the engine runs (0: skip)")
    p.add_argument("--engine-repeats", type=int, default=3)
    p.add_argument("--budget-sweep", action="store_true", help="only the PAD_BUDGET sweep (budget_sweep)")
    p.add_argument("--label", default="")
    p.add_argument("--results-dir", default="benchmarks/results")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedllm.bench.common import append_result, environment
    from pagedllm.ops.kernels import TorchKernels

    kernels = TorchKernels()
    results: dict[str, dict] = {}
    for name, shape in SHAPES.items():
        if args.budget_sweep:
            print(name)
            results[f"pad_budget_sweep_{name}"] = budget_sweep(shape, args.iters, args.repeats)
            continue
        built = cases(shape)
        calls = {c: partial(kernels.attend, q, q, q, kc, vc, m, 0.1) for c, (q, kc, vc, m) in built.items()}
        runs: dict[str, list[float]] = {c: [] for c in built}
        for _ in range(args.repeats):
            for c, ms in time_round_robin(calls, args.iters).items():
                runs[c].append(ms)
        med = {c: round(statistics.median(r), 3) for c, r in runs.items()}
        results[name] = {
            "shape_hq_hkv_d": list(shape),
            "median_ms": med,
            "runs_ms": {c: [round(x, 3) for x in r] for c, r in runs.items()},
            "mixed_over_short32": round(med["mixed"] / med["short32"], 2),
            "mixed_over_short32_plus_long1": round(med["mixed"] / (med["short32"] + med["long1"]), 2),
            "mixed_chunk_over_short32_plus_chunk": round(med["mixed_chunk"] / (med["short32"] + med["chunk"]), 2),
        }
        print(name, med, {k: v for k, v in results[name].items() if k.startswith("mixed")})
    if args.engine_tokens and not args.budget_sweep:
        results["engine_default_model"] = engine_runs(args.engine_repeats, args.engine_tokens)
        print("engine", results["engine_default_model"])
    row = {
        "benchmark": "cpu_attention",
        "label": args.label,
        "block_size": BLOCK_SIZE,
        "dtype": "float32",
        "iters": args.iters,
        "repeats": args.repeats,
        "engine_repeats": args.engine_repeats,
        "threads": torch.get_num_threads(),
        "cpu_model": cpu_model(),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),  # the box is shared: how loaded it was
        "results": results,
    }
    row.update(environment())
    if not args.no_save:
        print(append_result(row, args.results_dir, "cpu-attention"))


if __name__ == "__main__":
    main()
