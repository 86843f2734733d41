#!/usr/bin/env python3
"""FP8 KV cache: what one byte per element costs in accuracy and buys in capacity.

accuracy (default; CPU by default, or --device cuda): the bundled model with float32 weights, each
  fp8 KV format (--kv-dtypes, default fp8_e4m3 fp8_e5m2) against the same run with kv_cache_dtype
  auto. Held-out text: the model's 22 validation files (train_log.json "val_files", standard-library
  paths), found in THIS interpreter's stdlib; missing ones are skipped and the row names the ones used.
  (a) Perplexity: each file tokenized with the model's tokenizer, its first --ppl-tokens (2,047)
      tokens scored through SamplingParams(prompt_logprobs=0, max_tokens=1); total NLL / tokens
      scored (every prompt token after the first), exp of that, and the relative difference vs
      auto (the target: within 1%). Also the mean |logprob difference| per scored token.
  (b) Greedy agreement: --prompts (64) windows of --prompt-len (32) tokens at evenly spread
      offsets over the same files, --new-tokens (64) each, temperature 0, ignore_eos: the share of
      prompts whose tokens are all identical to auto's and the mean count of leading tokens that agree.
  The pool is sized to what the requests need (--num-kv-blocks overrides), so no run preempts.
  Pure prefill in pagedllm attends over K/V as the cache holds them (quantized, then read back), so
  the perplexity sees the fp8 rounding of every key and value, not just of the cached history.

capacity (CUDA only): --model DIR (random weights: tools/make_random_model.py --shape qwen3-0.6b |
  qwen3-8b --out DIR --device cuda), the profiled pool (gpu_memory_utilization 0.9, max_model_len
  4,096) with kv_cache_dtype auto (bf16) and then each --kv-dtypes (default fp8): num_kv_blocks,
  block_bytes, KV GiB and sequences = num_kv_blocks * block_size // --seq-len (4,096).
  --verify then submits that many --seq-len-token requests of random ids and checks that they run
  with no preemption and are all resident at once (peak running sequences == sequences). A request
  that finishes at its prefill frees its blocks before the later ones are admitted, so each request
  decodes --verify-output-len (1,024) tokens after a prompt of seq_len - that: the early ones are
  still decoding when the last prefill completes. max_num_seqs defaults to 1,024 with --verify (256
  without, LLM's default); --verify-timeout bounds the run (requests are aborted past it).

Every LLM is closed and freed before the next one is built. The engine flags are pagedllm's own
(entrypoints/args.py); the KV dtype is set per run from --kv-dtypes (auto first), so
--kv-cache-dtype is refused here. One row per invocation is appended to
benchmarks/results/kv-fp8-<mode>-<cpu|gpu>.json with the commit, GPU and library versions.

    python benchmarks/kv_cache_fp8.py                                          # accuracy, CPU
    python benchmarks/kv_cache_fp8.py accuracy --device cuda --dtype float32
    python benchmarks/kv_cache_fp8.py capacity --model /tmp/qwen3-8b-random --verify
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

MODES = ("accuracy", "capacity")
FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")
GiB = 1 << 30


def add_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.args import add_engine_args

    p.add_argument("mode", nargs="?", choices=MODES, default="accuracy", help="(default: accuracy)")
    add_engine_args(p)
    p.add_argument(
        "--kv-dtypes",
        nargs="+",
        choices=FP8,
        help="fp8 formats compared with auto (default: fp8_e4m3 fp8_e5m2 for accuracy, fp8 for capacity)",
    )
    a = p.add_argument_group("accuracy")
    a.add_argument("--max-files", type=int, help="score only the first N validation files found (default: all)")
    a.add_argument("--ppl-tokens", type=int, default=2047, help="tokens scored per file, at most (default: 2047)")
    a.add_argument("--prompts", type=int, default=64, help="greedy prompts (default: 64)")
    a.add_argument("--prompt-len", type=int, default=32, help="tokens per greedy prompt (default: 32)")
    a.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (default: 64)")
    c = p.add_argument_group("capacity")
    c.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence counted (default: 4096)")
    c.add_argument("--verify", action="store_true", help="run that many sequences at once and check it")
    c.add_argument("--verify-output-len", type=int, default=1024, help="decoded tokens per request (default: 1024)")
    c.add_argument("--verify-timeout", type=float, default=300.0, help="seconds, per KV dtype (default: 300)")
    p.add_argument("--results-dir", default="benchmarks/results", help="(default: benchmarks/results)")
    p.add_argument("--no-save", action="store_true", help="print only; append nothing to the results directory")
    p.add_argument("--out", help="also write this run's row as JSON to this file")
    p.add_argument("--label", default="", help="free text stored with the row")


def free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build(kwargs: dict, kv: str):
    from pagedllm import LLM

    return LLM(**{**kwargs, "kv_cache_dtype": kv})


def release(llm) -> None:
    """Close the engine; the caller drops its last reference and then calls free_device_memory."""
    llm.close()


def scales_summary(runner) -> dict:
    ks = [k for k, _ in runner.kv_scales]
    vs = [v for _, v in runner.kv_scales]
    return {
        "source": runner.kv_scales_source,
        "k_scale_min": min(ks),
        "k_scale_max": max(ks),
        "v_scale_min": min(vs),
        "v_scale_max": max(vs),
        "num_layers": len(ks),
    }


# ---- accuracy --------------------------------------------------------------------------
def validation_files(max_files: int | None = None) -> tuple[list[tuple[str, str]], list[str]]:
    """(relative path, absolute path) of the bundled model's validation files found in this
    interpreter's stdlib, in train_log.json's order; and the relative paths not found."""
    import sysconfig

    from pagedllm import default_model_path

    with open(os.path.join(default_model_path(), "train_log.json")) as f:
        names = json.load(f)["val_files"]
    stdlib = sysconfig.get_paths()["stdlib"]
    found = [(rel, os.path.join(stdlib, rel)) for rel in names if os.path.isfile(os.path.join(stdlib, rel))]
    missing = [rel for rel in names if not os.path.isfile(os.path.join(stdlib, rel))]
    return found[:max_files] if max_files is not None else found, missing


def encode_files(tokenizer, files: list[tuple[str, str]]) -> list[list[int]]:
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # "longer than the maximum sequence length": we cut
    try:
        out = []
        for _, path in files:
            with open(path, encoding="utf-8") as f:
                out.append(list(tokenizer.encode(f.read())))
        return out
    finally:
        transformers.logging.set_verbosity(verbosity)


def greedy_windows(token_lists: list[list[int]], n: int, length: int) -> list[list[int]]:
    """n windows of `length` tokens at evenly spread start offsets over all files' valid starts
    (a window never crosses a file's end); the middle of each of n equal stretches."""
    starts = [(f, s) for f, ids in enumerate(token_lists) for s in range(len(ids) - length + 1)]
    if len(starts) < n:
        raise ValueError(f"{n} windows of {length} tokens need more text than the files hold")
    picks = [starts[(2 * i + 1) * len(starts) // (2 * n)] for i in range(n)]
    return [token_lists[f][s : s + length] for f, s in picks]


def blocks_needed(prompts: list[list[int]], extra: int, block_size: int) -> int:
    """Blocks for every prompt resident at once, with `extra` generated tokens each."""
    return sum(-(-(len(p) + extra) // block_size) for p in prompts)


def score_prompts(llm, prompts: list[list[int]]) -> list[list[float]]:
    """Per prompt, the logprob of each of its tokens after the first (from prompt_logprobs=0)."""
    from pagedllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0), use_tqdm=False)
    scored = []
    for ids, out in zip(prompts, outs, strict=True):
        pl = out.prompt_logprobs
        assert pl is not None and len(pl) == len(ids) and pl[0] is None, "vLLM's shape: None, then one per token"
        scored.append([pl[i][tok].logprob for i, tok in enumerate(ids) if i > 0])
    return scored


def top2_gap(step: dict) -> float:
    """The best logprob minus the second best, of one position's {token: Logprob} (logprobs=2)."""
    best = sorted((x.logprob for x in step.values()), reverse=True)
    return best[0] - best[1]


def greedy(llm, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens per prompt, and at each position the gap between the two best logprobs."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(t) == new_tokens for t in tokens), "ignore_eos: every prompt runs to max_tokens"
    gaps = []
    for o in outs:
        steps = o.outputs[0].logprobs
        assert steps is not None and len(steps) == new_tokens
        gaps.append([top2_gap(d) for d in steps])
    return tokens, gaps


def leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=True):
        if x != y:
            break
        n += 1
    return n


def perplexity(scored: list[list[float]]) -> tuple[float, int, float]:
    nll = -sum(sum(s) for s in scored)
    tokens = sum(len(s) for s in scored)
    return nll, tokens, math.exp(nll / tokens)


def run_accuracy(args, kwargs: dict) -> dict:
    from pagedllm import default_model_path

    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("dtype", "float32")
    kv_dtypes = ["auto", *(args.kv_dtypes or ["fp8_e4m3", "fp8_e5m2"])]
    files, missing = validation_files(args.max_files)
    if not files:
        raise SystemExit("none of the validation files is in this interpreter's stdlib")
    from pagedllm.entrypoints.model_dir import load_tokenizer

    # the tokenizer LLM loads (llm.get_tokenizer()), read first: the pool is sized to the prompts
    token_lists = encode_files(load_tokenizer(kwargs.get("tokenizer") or kwargs["model"]), files)
    ppl_prompts = [ids[: args.ppl_tokens] for ids in token_lists]
    windows = greedy_windows(token_lists, args.prompts, args.prompt_len)
    bs = kwargs.get("block_size", 16)
    if kwargs.get("num_kv_blocks") is None and kwargs.get("kv_cache_memory_bytes") is None:
        kwargs["num_kv_blocks"] = max(blocks_needed(ppl_prompts, 1, bs), blocks_needed(windows, args.new_tokens, bs))
    runs: dict[str, dict] = {}
    for kv in kv_dtypes:
        llm = build(kwargs, kv)
        t = time.perf_counter()
        scored = score_prompts(llm, ppl_prompts)
        t_ppl = time.perf_counter() - t
        t = time.perf_counter()
        tokens, gaps = greedy(llm, windows, args.new_tokens)
        t_greedy = time.perf_counter() - t
        nll, n, ppl = perplexity(scored)
        runs[kv] = {
            "kv_cache_dtype": llm.get_metrics()["kv_cache_dtype"],
            "nll": nll,
            "tokens_scored": n,
            "perplexity": ppl,
            "perplexity_per_file": [round(perplexity([s])[2], 4) for s in scored],
            "scales": scales_summary(llm.runner) if kv != "auto" else None,
            "num_kv_blocks": llm.runner.num_kv_blocks,
            "block_bytes": llm.runner.block_bytes,
            "num_preemptions": llm.get_metrics()["num_preemptions"],
            "ppl_wall_s": round(t_ppl, 3),
            "greedy_wall_s": round(t_greedy, 3),
            "_scored": scored,
            "_tokens": tokens,
            "_gaps": gaps,
        }
        release(llm)
        del llm
        free_device_memory()
    base = runs["auto"]
    for kv in kv_dtypes:
        r = runs[kv]
        lead = [leading_agreement(a, b) for a, b in zip(base["_tokens"], r["_tokens"], strict=True)]
        diffs = [
            abs(x - y) for a, b in zip(base["_scored"], r["_scored"], strict=True) for x, y in zip(a, b, strict=True)
        ]
        r["perplexity_rel_diff_vs_auto"] = r["perplexity"] / base["perplexity"] - 1
        r["mean_abs_logprob_diff_vs_auto"] = statistics.fmean(diffs)
        r["max_abs_logprob_diff_vs_auto"] = max(diffs)
        r["greedy_identical_share"] = sum(n == args.new_tokens for n in lead) / len(lead)
        r["greedy_mean_leading_agree"] = statistics.fmean(lead)
        # where a prompt first differs, how close auto's own top two were: near-ties flip first
        at_split = [base["_gaps"][p][n] for p, n in enumerate(lead) if n < args.new_tokens]
        r["greedy_auto_top2_gap_at_divergence_median"] = statistics.median(at_split) if at_split else None
    all_gaps = [g for p in base["_gaps"] for g in p]
    for r in runs.values():
        del r["_scored"], r["_tokens"], r["_gaps"]
    return {
        "model": "default" if kwargs["model"] == default_model_path() else os.path.basename(kwargs["model"]),
        "device": kwargs["device"],
        "dtype": kwargs["dtype"],
        "files_used": [rel for rel, _ in files],
        "files_missing": missing,
        "ppl_tokens_per_file": args.ppl_tokens,
        "greedy_prompts": args.prompts,
        "greedy_prompt_len": args.prompt_len,
        "greedy_new_tokens": args.new_tokens,
        "greedy_auto_top2_gap_median": statistics.median(all_gaps),
        "runs": runs,
    }


def print_accuracy(row: dict) -> None:
    print(
        f"{len(row['files_used'])} files ({row['runs']['auto']['tokens_scored']} tokens scored), "
        f"{row['greedy_prompts']} prompts x {row['greedy_new_tokens']} greedy tokens; {row['device']} {row['dtype']}"
    )
    head = ("kv dtype", "ppl", "vs auto", "identical", "lead agree", "gap@split", "k scales", "v scales", "src")
    print("{:<10} {:>9} {:>9} {:>10} {:>11} {:>10} {:>18} {:>18} {:>9}".format(*head))
    for kv, r in row["runs"].items():
        s = r["scales"]
        k = f"{s['k_scale_min']:.3g}..{s['k_scale_max']:.3g}" if s else "-"
        v = f"{s['v_scale_min']:.3g}..{s['v_scale_max']:.3g}" if s else "-"
        src = s["source"].split()[0] if s else "-"
        gap = r["greedy_auto_top2_gap_at_divergence_median"]
        print(
            f"{kv:<10} {r['perplexity']:>9.4f} {100 * r['perplexity_rel_diff_vs_auto']:>+8.3f}% "
            f"{r['greedy_identical_share']:>10.3f} {r['greedy_mean_leading_agree']:>11.2f} "
            f"{'-' if gap is None else f'{gap:.3f}':>10} {k:>18} {v:>18} {src:>9}"
        )
    print(
        f"gap@split: median over the differing prompts of auto's top-1 minus top-2 logprob where they first differ "
        f"(all positions: {row['greedy_auto_top2_gap_median']:.3f})"
    )


# ---- capacity --------------------------------------------------------------------------
def pool_row(llm, seq_len: int) -> dict:
    r = llm.runner
    return {
        "kv_cache_dtype": llm.get_metrics()["kv_cache_dtype"],
        "num_kv_blocks": r.num_kv_blocks,
        "block_size": r.block_size,
        "block_bytes": r.block_bytes,
        "kv_gib": round(r.num_kv_blocks * r.block_bytes / GiB, 3),
        "sequences": r.num_kv_blocks * r.block_size // seq_len,
        "weights_gib": round(r.weights_bytes / GiB, 3),
        "peak_activation_gib": round(r.peak_activation_bytes / GiB, 3),
    }


def verify_capacity(llm, num_seqs: int, seq_len: int, output_len: int, timeout: float, seed: int) -> dict:
    """Submit num_seqs requests of seq_len tokens (prompt seq_len - output_len random ids, then
    output_len decoded) and step the engine until they finish or `timeout` passes (then abort)."""
    from pagedllm import SamplingParams

    engine = llm.engine
    scheduler, kv = engine.scheduler, engine.kv
    peak = {"blocks": 0, "running": 0}
    schedule = scheduler.schedule

    def probed():
        out = schedule()
        peak["blocks"] = max(peak["blocks"], kv.num_blocks - kv.num_free_blocks)
        peak["running"] = max(peak["running"], len(scheduler.running))
        return out

    rng = random.Random(seed)
    vocab = min(engine.vocab_size or 10000, 10000)
    prompt_len = seq_len - output_len
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    before = llm.get_metrics()["num_preemptions"]
    ids = [f"verify-{i}" for i in range(num_seqs)]
    for rid in ids:
        r = engine.input_processor.process(rid, [rng.randrange(vocab) for _ in range(prompt_len)], params)
        engine.add_request(rid, r, stream=False)
    scheduler.schedule = probed
    done: set[str] = set()
    t = time.perf_counter()
    try:
        while len(done) < num_seqs and time.perf_counter() - t < timeout:
            done.update(o.request_id for o in engine.step() if o.finished)
    finally:
        scheduler.schedule = schedule
        for rid in set(ids) - done:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():  # let aborted work drain (async scheduling)
            engine.step()
    wall = time.perf_counter() - t
    preemptions = llm.get_metrics()["num_preemptions"] - before
    return {
        "requests": num_seqs,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "finished": len(done),
        "timed_out": len(done) < num_seqs,
        "num_preemptions": preemptions,
        "peak_running": peak["running"],
        "peak_blocks_in_use": peak["blocks"],
        "wall_s": round(wall, 2),
        "ok": len(done) == num_seqs and preemptions == 0 and peak["running"] == num_seqs,
    }


def run_capacity(args, kwargs: dict) -> dict:
    import torch

    kwargs.setdefault("device", "cuda")
    if kwargs["device"] != "cuda" or not torch.cuda.is_available():
        raise SystemExit("capacity mode measures the profiled GPU pool: it needs CUDA (--device cuda)")
    kwargs.setdefault("max_model_len", args.seq_len)
    if args.seq_len > kwargs["max_model_len"]:
        raise SystemExit(f"--seq-len {args.seq_len} exceeds --max-model-len {kwargs['max_model_len']}")
    if args.verify:
        kwargs.setdefault("max_num_seqs", 1024)
        if not 1 <= args.verify_output_len < args.seq_len:
            raise SystemExit("--verify-output-len must be in [1, --seq-len)")
    runs: dict[str, dict] = {}
    for kv in ["auto", *(args.kv_dtypes or ["fp8"])]:
        llm = build(kwargs, kv)
        runs[kv] = pool_row(llm, args.seq_len)
        if kv != "auto":
            runs[kv]["scales"] = scales_summary(llm.runner)
        if args.verify:
            n = runs[kv]["sequences"]
            if n > llm.engine.scheduler.max_num_seqs:
                print(f"{kv}: {n} sequences > max_num_seqs; raise --max-num-seqs to verify them at once")
            runs[kv]["verify"] = verify_capacity(
                llm, n, args.seq_len, args.verify_output_len, args.verify_timeout, kwargs.get("seed", 0)
            )
        release(llm)
        del llm
        free_device_memory()
    for r in runs.values():
        r["sequences_vs_auto"] = round(r["sequences"] / max(1, runs["auto"]["sequences"]), 3)
    return {
        "model": os.path.basename(os.path.normpath(kwargs["model"])),
        "dtype": kwargs.get("dtype", "auto"),
        "seq_len": args.seq_len,
        "max_model_len": kwargs["max_model_len"],
        "gpu_memory_utilization": kwargs.get("gpu_memory_utilization", 0.9),
        "max_num_seqs": kwargs.get("max_num_seqs", 256),
        "gpu_total_gib": round(torch.cuda.get_device_properties(0).total_memory / GiB, 2),
        "runs": runs,
    }


def print_capacity(row: dict) -> None:
    print(f"{row['model']}: sequences of {row['seq_len']} tokens in the profiled pool")
    print(f"{'kv dtype':<10} {'blocks':>9} {'block B':>9} {'KV GiB':>8} {'sequences':>10} {'x auto':>7} {'verify':>22}")
    for kv, r in row["runs"].items():
        v = r.get("verify")
        vt = "-" if v is None else f"{'ok' if v['ok'] else 'FAIL'} {v['peak_running']}/{v['requests']} {v['wall_s']}s"
        print(
            f"{kv:<10} {r['num_kv_blocks']:>9} {r['block_bytes']:>9} {r['kv_gib']:>8.2f} {r['sequences']:>10} "
            f"{r['sequences_vs_auto']:>7.3f} {vt:>22}"
        )


def main(args) -> int:
    from pagedllm.bench.common import environment, gpu_slug, save_results
    from pagedllm.entrypoints.args import engine_kwargs

    if getattr(args, "kv_cache_dtype", None) is not None:
        raise SystemExit("--kv-cache-dtype: this benchmark runs auto and then each --kv-dtypes")
    for name in ("ppl_tokens", "prompts", "prompt_len", "new_tokens", "seq_len", "verify_output_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    kwargs = engine_kwargs(args)
    env = environment()
    if args.mode == "accuracy":
        result = run_accuracy(args, kwargs)
    else:
        result = run_capacity(args, kwargs)
    row = {"benchmark": "kv_cache_fp8", "mode": args.mode, **result, "label": args.label, "args": vars(args), **env}
    (print_accuracy if args.mode == "accuracy" else print_capacity)(row)
    save_results(row, args, f"kv-fp8-{args.mode}-{gpu_slug(env['gpu'])}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    sys.exit(main(parser.parse_args()))
