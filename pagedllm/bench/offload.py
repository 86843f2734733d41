"""`pagedllm bench offload`: the host KV tier (docs/features/host-kv-tier.md) on a multi-turn chat.

Scenario `chat`: conversations of growing turns behind a few shared system prompts; each round
sends every conversation's next turn (its history, the model's last answers included). The
distinct prefix KV of the workload is reported against the GPU pool (`prefix_over_pool`, the
issue asks for 2-4x). One row per host-tier size (`--tier-multiples`, in GPU pools; 0 = off):
hit rate per tier, the ideal hit rate (every block ever computed before kept: the longest
earlier prefix in whole blocks, last token excluded), mean TTFT and output throughput.

Scenario `preemption`: long outputs over a pool that forces preemption, once per preemption
mode (the tier at `--tier-multiples`' largest): throughput and the wait of preempted sequences.

Scenario `copy`: the tier's copy bandwidth each way, and the load of a `--prefix-len`-token
prefix from the host tier against its prefill (prefix caching off), on the engine's own buffers.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from pagedllm.bench.common import environment
from pagedllm.entrypoints.args import add_engine_args, engine_kwargs

GiB = 1 << 30


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p, {"num_kv_blocks": 64, "max_model_len": 2048}, why="this benchmark")
    p.add_argument("--scenario", choices=["chat", "preemption", "copy"], default="chat")
    p.add_argument(
        "--tier-multiples", type=float, nargs="+", default=[0, 1, 2, 4], help="host tier sizes, in GPU pools"
    )
    p.add_argument("--system-prompts", type=int, default=4, help="shared system prompts")
    p.add_argument("--system-len", type=int, default=128, help="tokens per system prompt")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-len", type=int, default=32, help="user tokens per turn")
    p.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="chat: 0 sends every conversation's next turn at once (rounds); K > 0 runs K clients, each "
        "sending its conversations' turns one at a time, the next when the answer is in (closed loop)",
    )
    p.add_argument("--output-len", type=int, default=16, help="answer tokens per turn (preemption: per request)")
    p.add_argument("--prefix-len", type=int, default=2048, help="copy: the prefix whose load is timed")
    p.add_argument("--output-json", help="append the rows (JSON lines) to this file")


def _ideal_hits(prompt: list[int], seen: set[tuple[int, ...]], bs: int) -> int:
    n = 0
    for k in range(1, (len(prompt) - 1) // bs + 1):
        if tuple(prompt[: k * bs]) not in seen:
            break
        n = k * bs
    return n


def _remember(tokens: list[int], seen: set[tuple[int, ...]], bs: int) -> None:
    for k in range(1, len(tokens) // bs + 1):
        seen.add(tuple(tokens[: k * bs]))


def _closed_loop(llm, args, history, rng, vocab: int, seen, params) -> tuple[list[float], int, int, int, dict]:
    """K clients (--concurrency); client k owns conversations k, k + K, ... and sends, turn by turn,
    each one's next turn once the previous request's answer is in: a conversation comes back after
    every other one's turn passed (its prefix evicted from a pool smaller than all of them), while
    only K requests are ever in flight. Returns (TTFTs, ideal hit tokens, query tokens, output
    tokens, a breakdown: engine steps from arrival to the first token, and step times)."""
    bs = llm.engine.config.block_size
    k = args.concurrency
    schedule = [[c for _ in range(args.turns) for c in range(j, args.conversations, k)] for j in range(k)]
    engine, inflight = llm.engine, {}
    ttfts: list[float] = []
    ideal, queries, out_tokens = 0, 0, 0
    sent_at: dict[str, int] = {}  # request id -> steps run before it arrived
    first_steps: list[int] = []
    step_s: list[float] = []

    def send(client: int) -> None:
        nonlocal ideal, queries
        if not schedule[client]:
            return
        c = schedule[client].pop(0)
        h = history[c]
        h += [rng.randrange(1, vocab) for _ in range(args.turn_len)]
        ideal += _ideal_hits(h, seen, bs)
        queries += len(h)
        _remember(h, seen, bs)
        rid = engine.add_request(None, list(h), params, stream=True)
        inflight[rid], sent_at[rid] = (client, c), len(step_s)

    for client in range(k):
        send(client)
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        step_s.append(time.perf_counter() - t)
        for o in outs:
            if o.request_id in sent_at and o.outputs[0].token_ids:
                first_steps.append(len(step_s) - sent_at.pop(o.request_id))
            if not o.finished:
                continue
            client, c = inflight.pop(o.request_id)
            ids = list(o.outputs[0].token_ids)
            out_tokens += len(ids)
            _remember(history[c] + ids, seen, bs)
            history[c] += ids
            if o.metrics is not None and o.metrics.first_token_time is not None:
                ttfts.append(o.metrics.first_token_time - o.metrics.arrival_time)
            send(client)
    mid = len(first_steps) // 2
    breakdown = {
        "median_steps_to_first_token": sorted(first_steps)[mid] if first_steps else 0,
        "median_step_ms": 1e3 * sorted(step_s)[len(step_s) // 2] if step_s else 0.0,
        "max_step_ms": 1e3 * max(step_s, default=0.0),
        "steps": len(step_s),
    }
    return ttfts, ideal, queries, out_tokens, breakdown


def run_chat(llm, args, vocab: int) -> dict:
    from pagedllm import SamplingParams

    rng = random.Random(args.seed or 0)
    bs = llm.engine.config.block_size
    systems = [[rng.randrange(1, vocab) for _ in range(args.system_len)] for _ in range(args.system_prompts)]
    history = [list(systems[c % len(systems)]) for c in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    seen: set[tuple[int, ...]] = set()
    ttfts: list[float] = []
    ideal, queries, out_tokens = 0, 0, 0
    before = llm.get_metrics()
    t0 = time.perf_counter()
    breakdown: dict = {}
    if args.concurrency > 0:
        ttfts, ideal, queries, out_tokens, breakdown = _closed_loop(llm, args, history, rng, vocab, seen, params)
    for _ in range(args.turns if args.concurrency <= 0 else 0):
        prompts = []
        for h in history:
            h += [rng.randrange(1, vocab) for _ in range(args.turn_len)]
            prompts.append(list(h))
            ideal += _ideal_hits(h, seen, bs)
            queries += len(h)
            _remember(h, seen, bs)  # the requests after it in the round may hit its blocks
        outs = llm.generate(prompts, params, use_tqdm=False)
        for h, o in zip(history, outs, strict=True):
            ids = list(o.outputs[0].token_ids)
            out_tokens += len(ids)
            _remember(h + ids, seen, bs)
            h += ids
            if o.metrics is not None and o.metrics.first_token_time is not None:
                ttfts.append(o.metrics.first_token_time - o.metrics.arrival_time)
    elapsed = time.perf_counter() - t0
    m = llm.get_metrics()
    d = {k: m[k] - before[k] for k in ("prefix_cache_query_tokens", "prefix_cache_hit_tokens")}
    q = d["prefix_cache_query_tokens"] or 1
    host = m["prefix_cache_host_hit_tokens"] - before["prefix_cache_host_hit_tokens"]
    return {
        "prefix_over_pool": round(len(seen) / max(1, m["num_kv_blocks"]), 2),
        "hit_rate": d["prefix_cache_hit_tokens"] / q,
        "gpu_hit_rate": (d["prefix_cache_hit_tokens"] - host) / q,
        "host_hit_rate": host / q,
        "ideal_hit_rate": ideal / max(1, queries),
        "concurrency": args.concurrency,
        "mean_ttft_s": sum(ttfts) / max(1, len(ttfts)),
        "median_ttft_s": sorted(ttfts)[len(ttfts) // 2] if ttfts else 0.0,
        "output_tok_s": out_tokens / elapsed,
        "elapsed_s": elapsed,
        "kv_load_seconds": m["kv_load_seconds"],
        "kv_load_bytes": m["kv_load_bytes"],
        "kv_offload_bytes": m["kv_offload_bytes"],
        "num_loaded_blocks": m["num_loaded_blocks"],
        "num_prefetched_blocks": m["num_prefetched_blocks"],
        **breakdown,
    }


def run_preemption(llm, args, vocab: int) -> dict:
    from pagedllm import SamplingParams

    rng = random.Random(args.seed or 0)
    prompts = [[rng.randrange(1, vocab) for _ in range(args.turn_len)] for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    m = llm.get_metrics()
    resumed = m["num_resumed_sequences"]
    return {
        "output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
        "elapsed_s": elapsed,
        "num_preemptions": m["num_preemptions"],
        "mean_preempted_wait_s": m["preempted_wait_seconds"] / resumed if resumed else 0.0,
        "num_swapped_out_blocks": m["num_swapped_out_blocks"],
        "prefix_cache_preempted_hit_tokens": m["prefix_cache_preempted_hit_tokens"],
    }


def run_copy(llm, args, vocab: int) -> dict:
    """Bandwidth of the runner's host buffer each way, and a prefix's load against its prefill."""
    import torch

    from pagedllm import SamplingParams

    runner = llm.runner
    host = getattr(runner, "host_kv", None)
    if host is None:
        raise ValueError("--scenario copy needs --kv-offloading-size > 0 and tensor_parallel_size 1")
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    bs = runner.block_size
    n = min(args.prefix_len // bs, host.num_blocks, runner.num_kv_blocks)

    def timed(fn) -> float:
        fn()  # warm
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    pairs = [(i, i) for i in range(n)]
    d2h = timed(lambda: host.offload(pairs))
    h2d = timed(lambda: host.load(pairs))
    nbytes = n * runner.block_bytes
    prompt = [random.Random(args.seed or 0).randrange(1, vocab) for _ in range(n * bs + 1)]
    llm.reset_prefix_cache()
    one = SamplingParams(temperature=0, max_tokens=1)
    prefill = timed(lambda: (llm.reset_prefix_cache(), llm.generate([prompt], one, use_tqdm=False)))
    return {
        "blocks": n,
        "bytes": nbytes,
        "d2h_GBps": nbytes / d2h / 1e9,
        "h2d_GBps": nbytes / h2d / 1e9,
        "prefix_tokens": n * bs,
        "prefix_load_s": h2d,
        "prefix_prefill_s": prefill,
    }


def main(args) -> int:
    from pagedllm import LLM

    kwargs = engine_kwargs(args)
    rows = []
    with LLM(**{**kwargs, "kv_offloading_size": 0.0, "preemption_mode": "recompute"}) as probe:
        pool_gib = probe.runner.num_kv_blocks * probe.runner.block_bytes / GiB
        vocab = probe.hf_config.vocab_size
    multiples = args.tier_multiples
    if args.scenario == "preemption":
        runs = [(max(multiples), mode) for mode in ("recompute", "swap")]
    elif args.scenario == "copy":
        runs = [(max(max(multiples), 1.0), "recompute")]
    else:
        runs = [(k, "recompute") for k in multiples]
    for k, mode in runs:
        size = k * pool_gib * kwargs.get("tensor_parallel_size", 1)
        with LLM(**{**kwargs, "kv_offloading_size": size, "preemption_mode": mode}) as llm:
            run = {"chat": run_chat, "preemption": run_preemption, "copy": run_copy}[args.scenario]
            row = {
                "scenario": args.scenario,
                "tier_multiple": k,
                "kv_offloading_size_gib": size,
                "preemption_mode": mode,
            }
            row.update(run(llm, args, vocab))
            row["num_kv_blocks"] = llm.runner.num_kv_blocks
            row["max_num_seqs"] = llm.engine.config.max_num_seqs
            row["max_num_batched_tokens"] = llm.engine.config.max_num_batched_tokens
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.output_json:
        env = environment()
        with open(args.output_json, "a") as f:
            for row in rows:
                f.write(json.dumps({**row, **env}) + "\n")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_args(p)
    sys.exit(main(p.parse_args()))
