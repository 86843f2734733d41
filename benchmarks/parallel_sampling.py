#!/usr/bin/env python3
"""Parallel sampling: one request of n=8 on a 1,024-token prompt vs the same 8 samples as 8 separate
requests, with prefix caching off and on.

Three ways to get 8 samples of one prompt (random token ids, `--prompt-len`), each sample
`--max-tokens` long (ignore_eos, temperature 1, seeds seed .. seed + 7):
  fork         one request, SamplingParams(n=8): the prompt is prefilled once and 8 children
               fork from it, sharing its blocks (copy-on-write on the partly filled last one)
  separate_off 8 requests, prefix caching off: the prompt is prefilled 8 times
  separate_on  8 requests, prefix caching on: all 8 are admitted in one step; the first one's
               blocks are registered when that step is scheduled, so the other 7 hit them
Each is run `--repeat` times (a fresh prompt each time, the prefix cache reset before), after a
warm-up; the median run is reported: wall time of `LLM.generate`, output tok/s (8 x max_tokens /
wall), TTFT (first token time - arrival, from RequestOutput.metrics: the request's, or the mean
and max of the 8), prompt tokens computed (counted at every schedule: the tokens of scheduled
chunks that lie in the prompt) and peak KV blocks in use (sampled after every schedule).

The engine flags are pagedllm's own (entrypoints/args.py), as in `pagedllm bench throughput`;
`--enable-prefix-caching` is set per variant. Rows are appended to
benchmarks/results/parallel-sampling-<gpu>.json with the commit, GPU and library versions.

    python benchmarks/parallel_sampling.py --model /tmp/qwen3-0.6b-random        # H200
    python benchmarks/parallel_sampling.py --prompt-len 64 --max-tokens 8 --repeat 1 --no-save   # CPU smoke
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

VARIANTS = ("fork", "separate_off", "separate_on")


def add_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.args import add_engine_args

    add_engine_args(p)
    p.add_argument("--n", type=int, default=8, help="samples of the one prompt (default: 8)")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens (default: 1024)")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per sample (default: 256)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per variant; the median is reported (default: 3)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--results-dir", default="benchmarks/results", help="(default: benchmarks/results)")
    p.add_argument("--no-save", action="store_true", help="print only; append nothing to the results directory")
    p.add_argument("--out", help="also write this run's rows as JSON to this file")
    p.add_argument("--label", default="", help="free text stored with the rows")


class ScheduleProbe:
    """Wraps the engine's Scheduler.schedule: after each schedule, the KV blocks in use and the
    prompt tokens the step computes."""

    def __init__(self, llm):
        self.scheduler = llm.engine.scheduler
        self.kv = llm.engine.kv
        self._schedule = self.scheduler.schedule
        self.scheduler.schedule = self.schedule
        self.reset()

    def reset(self) -> None:
        self.peak_blocks = 0
        self.prompt_tokens = 0

    def schedule(self):
        out = self._schedule()
        self.peak_blocks = max(self.peak_blocks, self.kv.num_blocks - self.kv.num_free_blocks)
        for s in out.scheduled:
            a = s.seq.num_computed_tokens
            self.prompt_tokens += max(0, min(a + s.num_new_tokens, s.seq.num_prompt_tokens) - a)
        return out


def run_variant(llm, probe: ScheduleProbe, variant: str, prompt: list[int], args) -> dict:
    from pagedllm import SamplingParams

    def params(n: int, seed: int) -> SamplingParams:
        return SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)

    if variant == "fork":
        prompts, plist = [prompt], [params(args.n, 0)]
    else:
        prompts, plist = [prompt] * args.n, [params(1, i) for i in range(args.n)]
    llm.reset_prefix_cache()
    probe.reset()
    before = llm.get_metrics()
    t = time.perf_counter()
    outs = llm.generate(prompts, plist, use_tqdm=False)
    wall = time.perf_counter() - t
    after = llm.get_metrics()
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert tokens == args.n * args.max_tokens, tokens
    ttft = [
        o.metrics.first_token_time - o.metrics.arrival_time for o in outs if o.metrics and o.metrics.first_token_time
    ]
    return {
        "wall_s": round(wall, 4),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 1),
        "ttft_mean_ms": round(1e3 * statistics.mean(ttft), 2),
        "ttft_max_ms": round(1e3 * max(ttft), 2),
        "prompt_tokens_computed": probe.prompt_tokens,
        "peak_kv_blocks": probe.peak_blocks,
        "prefix_cache_hit_tokens": after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
        "forked_sequences": after["num_forked_sequences"] - before["num_forked_sequences"],
        "copy_on_write_blocks": after["num_copy_on_write_blocks"] - before["num_copy_on_write_blocks"],
    }


def free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(args) -> int:
    from pagedllm import LLM, SamplingParams
    from pagedllm.bench.common import environment, gpu_slug, save_results
    from pagedllm.entrypoints.args import engine_kwargs

    if args.n < 2 or args.repeat < 1 or args.prompt_len < 1 or args.max_tokens < 1:
        raise ValueError("--n must be >= 2, --repeat, --prompt-len and --max-tokens >= 1")
    env = environment()
    kwargs = engine_kwargs(args)
    rng = random.Random(0)
    rows = []
    by_prefix = {True: [v for v in args.variants if v != "separate_off"], False: ["separate_off"]}
    for prefix, variants in by_prefix.items():
        variants = [v for v in variants if v in args.variants]
        if not variants:
            continue
        llm = LLM(**{**kwargs, "enable_prefix_caching": prefix})
        vocab = min(llm.engine.vocab_size or 10000, 10000)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, n=2, seed=0), use_tqdm=False)  # warm-up
        probe = ScheduleProbe(llm)
        for variant in variants:
            runs = []
            for _ in range(args.repeat):
                prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
                runs.append(run_variant(llm, probe, variant, prompt, args))
            best = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]  # the median run
            rows.append(
                {
                    "benchmark": "parallel_sampling",
                    "variant": variant,
                    "enable_prefix_caching": prefix,
                    "n": args.n,
                    "prompt_len": args.prompt_len,
                    "max_tokens": args.max_tokens,
                    "repeat": args.repeat,
                    **best,
                    "wall_s_all": [r["wall_s"] for r in runs],
                    "num_kv_blocks": llm.runner.num_kv_blocks,
                    "async_scheduling": llm.engine.async_scheduling,
                    "model": os.path.basename(os.path.normpath(args.model)) if args.model else "default",
                    "label": args.label,
                    **env,
                }
            )
        llm.close()
        del llm, probe  # free the weights and the KV tensor before the next engine profiles the GPU
        free_device_memory()
    rows.sort(key=lambda r: VARIANTS.index(r["variant"]))
    print(
        f"{'variant':<13} {'wall s':>8} {'tok/s':>9} {'TTFT mean/max ms':>18} {'prompt computed':>16} {'peak blocks':>12}"
    )
    for r in rows:
        ttft = f"{r['ttft_mean_ms']:.1f}/{r['ttft_max_ms']:.1f}"
        print(
            f"{r['variant']:<13} {r['wall_s']:>8.3f} {r['output_tokens_per_s']:>9.1f} {ttft:>18} "
            f"{r['prompt_tokens_computed']:>16} {r['peak_kv_blocks']:>12}"
        )
    save_results(rows, args, f"parallel-sampling-{gpu_slug(env['gpu'])}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    sys.exit(main(parser.parse_args()))
