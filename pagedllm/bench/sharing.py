"""KV memory saved by sharing: the vLLM paper's Fig. 15 (Kwon et al., SOSP 2023).

`--mode parallel` (the default) is parallel sampling, described here; `--mode beam` is beam
search (pagedllm/bench/sharing_beam.py).

Requests with prompt and output lengths drawn from distributions with the published means of
Alpaca (19 prompt / 58 output tokens) and ShareGPT (161 / 338) arrive as a Poisson process
(in engine steps) and run through the real Scheduler and LLMEngine over a fake executor that
only draws tokens (no model, no torch: seconds on a CPU). Each request asks for n samples; each
sample runs to its request's drawn output length (`--sample-lengths independent`: each draws its
own, and the fake emits EOS there). Every workload runs twice:
with sharing (one request with n: the prompt is computed once and its blocks shared by the n
children, copy-on-write on the last one) and without (n separate n=1 requests, prefix caching
off: what an engine without sharing holds). Block size 16, the paper's.

Reported: KV blocks in use, sampled at every step once it is scheduled (the blocks the forward
pass holds), as the time average over the run's steps and as the peak, with and without sharing,
and the saving 1 - with / without. The time average is the headline: the paper plots the
average memory saving over a serving trace, and a peak is one step's accident. Both runs see the
same arrivals and, with a token budget and a pool that never bind, the same step timeline, so
their averages are over the same steps (checked).
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.engine import LLMEngine, SamplingParams, SchedulerConfig
from pagedllm.engine.kv_cache_groups import KVCacheGroup
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.scheduler_output import SchedulerOutput
from pagedllm.engine.step_result import StepResult

EOS = 0
BLOCK_SIZE = 16
# published mean lengths (prompt, output) and the log-space spread assumed for each
DATASETS = {"alpaca": (19.0, 58.0, 0.5, 0.7), "sharegpt": (161.0, 338.0, 1.0, 0.8)}
PAPER_SAVING_PCT = {"alpaca": (6.1, 9.8), "sharegpt": (16.2, 30.5)}  # Fig. 15, n = 2 .. 6 (parallel sampling)
PAPER_BEAM_SAVING_PCT = {"alpaca": (37.6, 55.2), "sharegpt": (44.3, 66.3)}  # Fig. 15, widths 2 .. 6 (beam search)
MAX_LEN = 1024  # each of prompt and output is clipped to [1, MAX_LEN]


def draw(rng: random.Random, mean: float, sigma: float, distribution: str) -> int:
    """One length with the given mean (before clipping): lognormal with log-space sigma, or exponential."""
    if distribution == "exponential":
        x = rng.expovariate(1.0 / mean)
    else:
        x = rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)
    return min(MAX_LEN, max(1, round(x)))


@dataclass
class Workload:
    arrivals: list[int]  # engine step at which request j arrives
    prompts: list[list[int]]
    output_lens: list[list[int]]  # [request][sample]


def make_workload(
    dataset: str, n: int, num_requests: int, concurrency: float, seed: int, distribution: str, same_length: bool
):
    """Arrivals and lengths, the same for every n (a request's samples draw from a stream of their
    own). Arrival rate: `concurrency` requests alive on average (rate = concurrency / mean output
    length, per step). same_length: every sample of a request has the request's output length
    (vLLM's benchmarks: ignore_eos, max_tokens = the dataset's output length); else each draws its own."""
    p_mean, o_mean, p_sigma, o_sigma = DATASETS[dataset]
    rng = random.Random(seed)
    rate = concurrency / o_mean
    t, arrivals, prompts, outs = 0.0, [], [], []
    for j in range(num_requests):
        t += rng.expovariate(rate)
        arrivals.append(int(t))
        prompts.append([1 + rng.randrange(30000) for _ in range(draw(rng, p_mean, p_sigma, distribution))])
        srng = random.Random(seed * 1_000_003 + j)
        lens = [draw(srng, o_mean, o_sigma, distribution) for _ in range(n)]
        outs.append([lens[0]] * n if same_length else lens)
    return Workload(arrivals, prompts, outs)


def contiguous_blocks(out: SchedulerOutput) -> int:
    """The blocks the step's sequences would hold as one contiguous copy each (no sharing: HF's
    per-sequence caches, or an engine without fork): for every scheduled sequence, and for every
    child forked from its row, ceil(tokens it holds after this step's writes / block size).
    Every live sequence is scheduled at every step when the token budget and pool never bind."""
    total = 0
    for s in out.scheduled:
        copies = len(s.sample_seqs) if s.samples else 1
        total += copies * -(-(s.seq.num_computed_tokens + s.num_new_tokens) // BLOCK_SIZE)
    return total


class StepRecorder:
    """What both fake executors of this benchmark record at each launch (the pool after the step
    was scheduled): the blocks in use, what the step's sequences would hold without sharing
    (contiguous_blocks), and the prompt tokens the step computes."""

    supports_async = False
    kv_cache_groups = (KVCacheGroup((0,)),)  # one full-attention group: the layers do not matter here

    def __init__(self, num_kv_blocks: int):
        self.num_kv_blocks = num_kv_blocks
        self.engine: LLMEngine | None = None
        self.blocks_in_use: list[int] = []
        self.contiguous: list[int] = []
        self.prompt_tokens_computed = 0

    def record(self, out: SchedulerOutput) -> None:
        assert self.engine is not None
        kv = self.engine.kv
        self.blocks_in_use.append(kv.num_blocks - kv.num_free_blocks)
        self.contiguous.append(contiguous_blocks(out))
        for s in out.scheduled:
            a = s.seq.num_computed_tokens
            self.prompt_tokens_computed += max(0, min(a + s.num_new_tokens, s.seq.num_prompt_tokens) - a)

    def execute_async(self, out: SchedulerOutput):
        raise NotImplementedError(f"{type(self).__name__} runs synchronously")

    def close(self) -> None:
        pass


class LengthExecutor(StepRecorder):
    """An Executor standing for a model: each sample row gets a non-EOS token until its sample's
    drawn length (looked up by the row's seed), then EOS."""

    def __init__(self, num_kv_blocks: int, lengths: dict[int, int]):
        super().__init__(num_kv_blocks)
        self.lengths = lengths

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.record(out)
        sampled = []
        for s in out.scheduled:
            if not s.samples:
                continue
            for q in s.sample_seqs:
                seed = q.sampling_params.seed
                assert seed is not None
                sampled.append(EOS if q.num_output_tokens + 1 >= self.lengths[seed] else 1 + q.num_tokens % 30000)
        return StepResult(sampled)


def make_engine(executor, num_blocks: int) -> LLMEngine:
    """An engine over the fake executor whose pool and token budget never bind (no preemption,
    every live sequence scheduled at every step), prefix caching off."""
    cfg = SchedulerConfig(
        num_kv_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=1 << 20,
        max_num_batched_tokens=1 << 24,
        max_model_len=2 * MAX_LEN + 1,
        enable_prefix_caching=False,
    )
    return LLMEngine(cfg, executor, eos_token_ids={EOS})


def drive(engine: LLMEngine, w: Workload, add: Callable[[int], None]) -> list[RequestOutput]:
    """Step the engine over the workload's arrivals (add(j) submits request j at its step; idle
    stretches are skipped) until everything is finished: the finished RequestOutputs."""
    step = next_req = 0
    done = []
    while next_req < len(w.prompts) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            step = max(step, w.arrivals[next_req])  # idle until the next arrival
        while next_req < len(w.prompts) and w.arrivals[next_req] <= step:
            add(next_req)
            next_req += 1
        done += [o for o in engine.step() if o.finished]
        step += 1
    return done


def run_once(w: Workload, n: int, shared: bool) -> dict:
    """One pass over the workload: one request with n samples each (shared), or n requests each."""
    need = sum(len(p) + sum(o) for p, o in zip(w.prompts, w.output_lens, strict=True))
    num_blocks = need // BLOCK_SIZE + 2 * n * len(w.prompts) + 16  # never binds: no preemption, same timeline
    lengths = {j * 64 + i: w.output_lens[j][i] for j in range(len(w.prompts)) for i in range(n)}
    executor = LengthExecutor(num_blocks, lengths)
    engine = make_engine(executor, num_blocks)
    executor.engine = engine

    def add(j: int) -> None:
        max_tokens = max(w.output_lens[j])
        if shared:
            params = SamplingParams(n=n, seed=j * 64, max_tokens=max_tokens, temperature=1.0)
            engine.add_request(f"r{j}", w.prompts[j], params, stream=False)
        else:
            for i in range(n):
                params = SamplingParams(seed=j * 64 + i, max_tokens=max_tokens, temperature=1.0)
                engine.add_request(f"r{j}.{i}", w.prompts[j], params, stream=False)

    t0 = time.perf_counter()
    drive(engine, w, add)
    m = engine.get_metrics()
    assert m["num_preemptions"] == 0 and m["num_free_kv_blocks"] == num_blocks
    used = executor.blocks_in_use
    return {
        "steps": len(used),
        "peak_blocks": max(used),
        "mean_blocks": sum(used) / len(used),
        "peak_contiguous_blocks": max(executor.contiguous),
        "mean_contiguous_blocks": sum(executor.contiguous) / len(executor.contiguous),
        "prompt_tokens_computed": executor.prompt_tokens_computed,
        "generated_tokens": m["num_generation_tokens"],
        "forked_sequences": m["num_forked_sequences"],
        "copy_on_write_blocks": m["num_copy_on_write_blocks"],
        "seconds": round(time.perf_counter() - t0, 3),
    }


def measure(dataset: str, n: int, args) -> dict:
    same = args.sample_lengths == "same"
    w = make_workload(dataset, n, args.num_requests, args.concurrency, args.seed, args.distribution, same)
    with_, without = run_once(w, n, shared=True), run_once(w, n, shared=False)
    assert with_["steps"] == without["steps"] and with_["generated_tokens"] == without["generated_tokens"]
    lo, hi = PAPER_SAVING_PCT[dataset]
    return {
        "dataset": dataset,
        "n": n,
        "mean_prompt_len": round(sum(map(len, w.prompts)) / len(w.prompts), 1),
        "mean_output_len": round(sum(sum(o) for o in w.output_lens) / (n * len(w.prompts)), 1),
        "time_avg_blocks_without": round(without["mean_blocks"], 1),
        "time_avg_blocks_with": round(with_["mean_blocks"], 1),
        "time_avg_saving_pct": round(100 * (1 - with_["mean_blocks"] / without["mean_blocks"]), 1),
        "peak_blocks_without": without["peak_blocks"],
        "peak_blocks_with": with_["peak_blocks"],
        "peak_saving_pct": round(100 * (1 - with_["peak_blocks"] / without["peak_blocks"]), 1),
        "paper_saving_pct_n2_to_n6": f"{lo}-{hi}",
        "with_sharing": with_,
        "without_sharing": without,
    }


def environment() -> dict:
    from pagedllm.bench.common import git_commit
    from pagedllm.envs import commit

    return {
        "commit": commit() or git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
    }
