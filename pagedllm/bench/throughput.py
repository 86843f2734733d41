"""Offline throughput: nano-vllm's workload, reproduced exactly.

random.seed(0); 256 requests of randint(100, 1024) random token ids, each with
SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, 1024)):
133,966 output tokens in all. One warm-up request, then `generate` over all of them is timed.
--model DIR is required (the token ids go up to 10000: e.g. a model from tools/make_random_model.py);
the engine flags are pagedllm's own (entrypoints/args.py), with max_model_len 4096 by default here.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import random
import sys
import time
from collections.abc import Callable
from typing import Any

TOTAL_OUTPUT_TOKENS = 133_966


# --structured-output json: every request's output must match this schema. An array of at least
# 2,000 short strings cannot be complete within the workload's 1,024 tokens, so every request
# still writes exactly max_tokens tokens and the run is the standard one plus a token mask per step.
BENCH_SCHEMA: dict[str, Any] = {"type": "array", "items": {"type": "string", "maxLength": 32}, "minItems": 2000}


def workload(num_seqs: int = 256, structured_output: str = "none"):
    from pagedllm import SamplingParams
    from pagedllm.engine.sampling_params import StructuredOutputsParams

    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    params = [
        SamplingParams(
            temperature=0.6,
            ignore_eos=True,
            max_tokens=random.randint(100, 1024),
            structured_outputs=StructuredOutputsParams(json=BENCH_SCHEMA) if structured_output == "json" else None,
        )
        for _ in range(256)
    ]
    assert sum(p.max_tokens for p in params) == TOTAL_OUTPUT_TOKENS
    return prompts[:num_seqs], params[:num_seqs]


STANDARD_MAX_MODEL_LEN = 4096  # the workload's longest request (1024 + 1024 tokens) fits, as in nano-vllm's run


def add_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.args import add_engine_args

    add_engine_args(p, {"max_model_len": STANDARD_MAX_MODEL_LEN}, why="the standard workload")
    p.add_argument("--num-seqs", type=int, default=256, help="run the first N requests of the workload (default: 256)")
    p.add_argument("--compare-hf", action="store_true", help="also run HF transformers' continuous batching")
    p.add_argument("--hf-eager", action="store_true", help="HF continuous batching without its CUDA graphs")
    p.add_argument("--hf-memory-percent", type=float, default=0.9, help="HF's KV cache share of the GPU (default 0.9)")
    p.add_argument("--skip-pagedllm", action="store_true")
    p.add_argument("--results-dir", default="benchmarks/results", help="(default: benchmarks/results)")
    p.add_argument("--out", help="also write this run's rows as JSON to this file")
    p.add_argument("--label", default="", help="free text stored with the row")
    p.add_argument(
        "--structured-output",
        choices=("none", "json"),
        default="none",
        help="json: every request carries a JSON schema it cannot complete within its max_tokens "
        "(the cost of structured output on the standard workload)",
    )
    p.add_argument(
        "--profile-steps",
        default=None,
        metavar="START:END",
        help="torch.profiler over engine steps START..END of the timed run; the top ops "
        "by device time go to the results directory as a text table",
    )

    p.add_argument(
        "--host-profile",
        default=None,
        metavar="START:END[,START:END]",
        help="cProfile the host over engine steps START..END of the timed run (several windows: comma-separated); "
        "the functions by own time, then by cumulative time, go to the results directory as "
        "host_profile_START_END.txt",
    )


class StepTimer:
    """Per engine step: wall time, and GPU time of the step's kernels (CUDA events around the
    launch). step - gpu is the host time the GPU waits for (all of it without async scheduling)."""

    def __init__(self, llm):
        import torch

        self.torch = torch
        self.rows: list[dict[str, Any]] = []
        engine = llm.engine
        runner = getattr(llm.runner, "driver", None) or llm.runner  # TP: rank 0's ModelRunner
        self._step, self._launch = engine.step, runner.launch
        engine.step = self.step
        runner.launch = self.launch
        self.cur: dict[str, Any] = {}
        self.window: tuple[int, int] | None = None  # engine steps START..END to profile
        self.profile_path = ""
        self.prof: Any = None
        self.host_windows: list[tuple[int, int, Any, str]] = []  # (start, end, cProfile.Profile, path)
        self.gc_pauses: list[tuple[int, int, float]] = []  # (generation, step index, ms)
        self._gc_t0 = 0.0
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_pauses.append((info["generation"], len(self.rows), (time.perf_counter() - self._gc_t0) * 1e3))

    def close(self) -> None:
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        for start, end, prof, path in self.host_windows:
            text = io.StringIO()
            text.write(f"host time of engine steps {start}..{end} (cProfile; the timed steps are slower under it)\n")
            for key in ("tottime", "cumulative"):
                pstats.Stats(prof, stream=text).sort_stats(key).print_stats(45)
            with open(path, "w") as f:
                f.write(text.getvalue())

    def host_profile(self, windows: str, results_dir: str) -> None:
        for window in windows.split(","):
            start, end = (int(x) for x in window.split(":"))
            path = os.path.join(results_dir, f"host_profile_{start}_{end}.txt")
            self.host_windows.append((start, end, cProfile.Profile(), path))

    def launch(self, inp):
        ev0, ev1 = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
        ev0.record()
        out = self._launch(inp)
        ev1.record()
        self.cur.update(events=(ev0, ev1), batch=inp.num_seqs, decode=inp.decode_only)
        return out

    def profile(self, window: str, path: str) -> None:
        start, end = (int(x) for x in window.split(":"))
        self.window, self.profile_path = (start, end), path

    def step(self):
        window = self.window
        if window and len(self.rows) == window[0] and self.prof is None:
            self.prof = self.torch.profiler.profile(
                activities=[self.torch.profiler.ProfilerActivity.CPU, self.torch.profiler.ProfilerActivity.CUDA]
            )
            self.prof.__enter__()
        if window and len(self.rows) == window[1] and self.prof is not None:
            self.prof.__exit__(None, None, None)
            sort = "cuda_time_total" if self.torch.cuda.is_available() else "cpu_time_total"
            with open(self.profile_path, "w") as f:
                f.write(self.prof.key_averages().table(sort_by=sort, row_limit=40))
            self.window = None
        self.cur = {}
        n = len(self.rows)
        prof = next((w[2] for w in self.host_windows if w[0] <= n < w[1]), None)
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        out = self._step()
        self.cur["step_s"] = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
        if "events" in self.cur:
            self.rows.append(self.cur)
        return out

    def summary(self) -> dict:
        """Decode steps at batch >= 200 (the host vs GPU split of README's benchmark table), and where the whole run's
        time goes: steps, wall seconds and GPU seconds per kind of step."""
        self.torch.cuda.synchronize()
        for r in self.rows:
            r["gpu_s"] = r["events"][0].elapsed_time(r["events"][1]) / 1e3
        out = {}
        dec = [r for r in self.rows if r["decode"] and r["batch"] >= 200]
        if dec:
            step = sum(r["step_s"] for r in dec) * 1e3 / len(dec)
            gpu = sum(r["gpu_s"] for r in dec) * 1e3 / len(dec)
            out = {
                "decode_steps_measured": len(dec),
                "batch_mean": sum(r["batch"] for r in dec) / len(dec),
                "step_ms": step,
                "gpu_ms": gpu,
                "host_exposed_ms": step - gpu,
            }
        buckets: dict[str, Callable[[dict[str, Any]], bool]] = {"prefill_or_mixed": lambda r: not r["decode"]}

        def decode_batch(lo: int, hi: int) -> Callable[[dict[str, Any]], bool]:
            return lambda r: bool(r["decode"]) and lo <= r["batch"] <= hi

        for lo, hi in ((1, 16), (17, 64), (65, 128), (129, 200), (201, 100000)):
            buckets[f"decode_batch_{lo}_{hi}"] = decode_batch(lo, hi)
        # where the host held the GPU up: the steps whose wall time exceeds their GPU time the most
        rows = self.rows
        gaps = sorted(range(len(rows)), key=lambda i: rows[i]["step_s"] - rows[i]["gpu_s"], reverse=True)[:5]
        out["largest_host_gaps"] = [
            {
                "step": i,
                "batch": rows[i]["batch"],
                "decode": rows[i]["decode"],
                "ms": round((rows[i]["step_s"] - rows[i]["gpu_s"]) * 1e3, 2),
            }
            for i in gaps
        ]
        out["gc"] = {
            f"gen{g}": {
                "count": len(ps),
                "total_ms": round(sum(p[2] for p in ps), 2),
                "max_ms": round(max((p[2] for p in ps), default=0.0), 2),
                **({"at_steps": [p[1] for p in ps][:10]} if g == 2 else {}),
            }
            for g in (0, 1, 2)
            for ps in [[p for p in self.gc_pauses if p[0] == g]]
        }
        out["time_by_step_kind"] = {
            name: {
                "steps": len(rs),
                "wall_s": round(sum(r["step_s"] for r in rs), 3),
                "gpu_s": round(sum(r["gpu_s"] for r in rs), 3),
            }
            for name, pick in buckets.items()
            if (rs := [r for r in self.rows if pick(r)])
        }
        return out


def run_pagedllm(args, prompts, params) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.args import LLM_DEFAULTS, engine_kwargs

    kwargs = engine_kwargs(args)
    config = {**LLM_DEFAULTS, **kwargs}
    llm = LLM(**kwargs)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    timer = StepTimer(llm) if llm.runner.device.type == "cuda" else None
    if timer is not None and args.profile_steps:
        timer.profile(args.profile_steps, os.path.join(args.results_dir, "profile_steps.txt"))
    if timer is not None and args.host_profile:
        timer.host_profile(args.host_profile, args.results_dir)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(p.max_tokens for p in params), (tokens, sum(p.max_tokens for p in params))
    row = {
        "engine": "pagedllm",
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "num_seqs": len(prompts),
        "num_kv_blocks": llm.runner.num_kv_blocks,
        "metrics": llm.get_metrics(),
        "enforce_eager": config["enforce_eager"],
        "tensor_parallel_size": config["tensor_parallel_size"],
        "async_scheduling": llm.engine.async_scheduling,
    }
    if timer is not None:
        timer.close()
        row["per_step"] = timer.summary()
    llm.close()
    return row


def run_hf(args, prompts, params) -> dict:
    """HF transformers continuous batching, its best measured configuration (README, Benchmarks)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    model: Any = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16, attn_implementation="paged|sdpa"
    )
    model = model.cuda().eval()
    gen = GenerationConfig(
        do_sample=True, temperature=0.6, top_p=1.0, top_k=0, max_new_tokens=1024, eos_token_id=-1, pad_token_id=0
    )
    graphs = not args.hf_eager
    mem = args.hf_memory_percent
    cb = ContinuousBatchingConfig(use_cuda_graph=graphs, max_batch_tokens=8192, max_memory_percent=mem)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()

    def run_all(ps, ms):
        ids = [
            manager.add_request(p, request_id=f"r{i}-{time.monotonic_ns()}", max_new_tokens=m)
            for i, (p, m) in enumerate(zip(ps, ms, strict=False))
        ]
        want, got = set(ids), 0
        while want:
            r = manager.get_result(timeout=600)
            if r is None:
                raise RuntimeError("HF continuous batching returned no result")
            if r.request_id in want and r.is_finished():
                if not r.generated_tokens:  # HF reports a failed request as finished, with its error
                    raise RuntimeError(f"HF finished {r.request_id} with no token: {getattr(r, 'error', None)}")
                want.discard(r.request_id)
                got += len(r.generated_tokens)
        return got

    run_all([prompts[0][:8]], [8])  # warm-up
    t = time.perf_counter()
    tokens = run_all(prompts, [p.max_tokens for p in params])
    seconds = time.perf_counter() - t
    manager.stop(block=True)
    return {
        "engine": "hf-transformers-cb",
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "num_seqs": len(prompts),
        "config": f"paged|sdpa, ContinuousBatchingConfig(use_cuda_graph={graphs}, max_batch_tokens=8192, "
        f"max_memory_percent={mem})",
    }


def main(args) -> int:
    from pagedllm.bench.common import append_result, environment

    if args.model is None:  # the bundled model's vocabulary is smaller than the workload's token ids
        raise ValueError("bench throughput needs --model DIR, e.g. a model made by tools/make_random_model.py")
    prompts, params = workload(args.num_seqs, args.structured_output)
    env = environment()
    rows = []
    if not args.skip_pagedllm:
        rows.append(run_pagedllm(args, prompts, params))
    if args.compare_hf:
        try:
            rows.append(run_hf(args, prompts, params))
        except Exception as e:  # report, do not lose the pagedllm row
            rows.append({"engine": "hf-transformers-cb", "error": f"{type(e).__name__}: {e}"})
    ours = next((r for r in rows if r["engine"] == "pagedllm"), None)
    hf = next((r for r in rows if r["engine"] == "hf-transformers-cb" and "tokens_per_s" in r), None)
    for r in rows:
        r.update(
            {
                "benchmark": "throughput",
                "model": os.path.basename(os.path.normpath(args.model)),
                "label": args.label,
                "structured_output": args.structured_output,
                **env,
            }
        )
        if ours and hf:
            r["ratio_vs_hf"] = round(ours["tokens_per_s"] / hf["tokens_per_s"], 2)
        path = append_result(r, args.results_dir)
        print(
            f"{r['engine']}: "
            + (
                f"{r['output_tokens']} tokens in {r['seconds']:.2f} s = {r['tokens_per_s']:.0f} tok/s"
                if "tokens_per_s" in r
                else r["error"]
            )
        )
        if "per_step" in r:
            print(f"  per decode step at batch >= 200: {json.dumps(r['per_step'])}")
    if ours and hf:
        print(f"pagedllm / HF = {rows[0]['ratio_vs_hf']:.2f}x")
    print(f"results appended to {path}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    sys.exit(main(parser.parse_args()))
