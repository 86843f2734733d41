"""Host time of one engine step, without a model: the control plane and the output path alone.

An executor that returns a token at once stands in for the model, so what is timed is the
scheduler, the KV-cache manager and the output processing (detokenizer, RequestOutputs) of
`LLMEngine.step` with N requests running, streamed and not; and the steps that admit a 512-token
prompt beside 3 decodes (the 16 req/s serving load), with prefix caching on and off. Also the
cost of pickling one step's message to the engine-core process, and what the model runner builds
on the host for a decode step (its StepInputs and SamplingTensors) at 1-256 sequences. Runs against whatever `pagedllm` is importable, so
an older checkout can be measured with the same script (PYTHONPATH=OLD python benchmarks/host_step.py).

    python benchmarks/host_step.py --label after --results-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time


class InstantExecutor:
    """One sampled id per sampling sequence, at once (an Executor: engine/executor.py)."""

    num_kv_blocks = 40_000
    supports_async = False

    @property
    def kv_cache_groups(self):
        from pagedllm.engine.kv_cache_groups import KVCacheGroup  # read only by engines that have groups

        return (KVCacheGroup((0,)),)

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def execute(self, out):
        from pagedllm.engine.step_result import StepResult

        return StepResult([self.rng.randrange(100, 8000) for s in out.scheduled if s.samples])

    def close(self) -> None:
        pass


def instant_engine(tokenizer, prefix_caching: bool = True, executor: InstantExecutor | None = None):
    """An LLMEngine over an InstantExecutor (default a new one), the serving benchmark's scheduler limits."""
    from pagedllm.engine import LLMEngine, SchedulerConfig

    cfg = SchedulerConfig(
        num_kv_blocks=40_000,
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=4096,
        enable_prefix_caching=prefix_caching,
    )
    return LLMEngine(cfg, executor or InstantExecutor(), tokenizer, {0}, vocab_size=8192)


class WorkerInputsExecutor(InstantExecutor):
    """InstantExecutor that also builds what the model runner builds on the host for each step: its
    StepInputs (worker/step_inputs.py, block tables kept across steps) and SamplingTensors
    (worker/sampler.py, on CPU tensors), timed for decode steps."""

    def __init__(self) -> None:
        import numpy as np

        from pagedllm.worker.step_inputs import BlockTableRows

        super().__init__()
        self.rows, self.philox = BlockTableRows(), np.random.default_rng(0)
        self.times: dict[str, list[float]] = {"step_inputs": [], "sampling_tensors": []}

    def execute(self, out):
        import torch

        from pagedllm.worker.sampler import sampling_tensors
        from pagedllm.worker.step_inputs import build_step_inputs

        t0 = time.perf_counter()
        inp = build_step_inputs(out, 16, 8192, frozenset({0}), self.kv_cache_groups, self.rows, None)
        t1 = time.perf_counter()
        if len(inp.logits_indices):
            sampling_tensors(inp, 8192, torch.device("cpu"), torch.from_numpy, self.philox)
        if all(s.num_new_tokens == 1 for s in out.scheduled):
            self.times["step_inputs"].append(t1 - t0)
            self.times["sampling_tensors"].append(time.perf_counter() - t1)
        return super().execute(out)


def time_worker_inputs(num_seqs: int) -> dict[str, float]:
    """Median us per decode step of the runner's host-side inputs, num_seqs greedy sequences of 512 + 128."""
    from pagedllm.engine import SamplingParams

    executor = WorkerInputsExecutor()
    engine = instant_engine(None, executor=executor)
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", [rng.randrange(100, 8000) for _ in range(512)], params, stream=False)
    while engine.has_unfinished_requests():
        engine.step()
    return {k: round(statistics.median(v) * 1e6, 1) for k, v in executor.times.items()}


def time_steps(tokenizer, num_requests: int, stream: bool) -> float:
    """Mean ms per step of a whole run: num_requests prompts of 512 tokens, 128 greedy tokens each."""
    from pagedllm.engine import SamplingParams

    engine = instant_engine(tokenizer)
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(f"r{i}", [rng.randrange(100, 8000) for _ in range(512)], params, stream=stream)
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / steps * 1e3


def time_admitting(tokenizer, prefix_caching: bool, steps: int = 400, every: int = 10) -> dict[str, float]:
    """The serving benchmark at 16 req/s, as the core sees it: 3 long decodes, and every `every`
    steps a new prompt of 512 tokens (8 out) is admitted. Median ms of the steps that admit one
    (scheduling the prefill: prefix-cache lookup, block hashing and registration) and of the rest."""
    from pagedllm.engine import SamplingParams

    engine = instant_engine(tokenizer, prefix_caching)
    rng = random.Random(1)
    long = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"l{i}", [rng.randrange(100, 8000) for _ in range(512)], long, stream=True)
    for _ in range(5):
        engine.step()
    admitting, decoding = [], []
    for k in range(steps):
        new = k % every == 0
        if new:
            ids = [rng.randrange(100, 8000) for _ in range(512)]
            engine.add_request(f"n{k}", ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), stream=True)
        start = time.perf_counter()
        engine.step()
        (admitting if new else decoding).append((time.perf_counter() - start) * 1e3)
    return {"admitting_ms": round(statistics.median(admitting), 3), "decode_ms": round(statistics.median(decoding), 3)}


def pickle_us(obj, repeat: int = 2000) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return (time.perf_counter() - start) / repeat * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3, help="runs per mode; the median is recorded")
    p.add_argument("--label", default="")
    p.add_argument("--results-dir", default="benchmarks/results")
    args = p.parse_args()
    from transformers import AutoTokenizer

    import pagedllm
    from pagedllm.bench.common import append_result, environment

    tokenizer = AutoTokenizer.from_pretrained(pagedllm.default_model_path())
    results: dict[str, object] = {}
    for stream in (False, True):
        runs = [time_steps(tokenizer, args.num_requests, stream) for _ in range(args.repeats)]
        results["streamed" if stream else "not_streamed"] = {
            "median_ms_per_step": round(statistics.median(runs), 3),
            "runs_ms_per_step": [round(r, 3) for r in runs],
        }
    for caching in (True, False):
        results[f"admit_512_prefix_caching_{'on' if caching else 'off'}"] = time_admitting(tokenizer, caching)
    try:  # the model runner's host-side inputs of a decode step, by batch size
        results["worker_decode_inputs_us"] = {n: time_worker_inputs(n) for n in (1, 4, 16, 64, 256)}
    except ImportError:
        pass  # an older tree without these worker modules
    # one step's message to the engine-core process, 256 sequences of one new token each
    rows = [(str(i), 0, [1234], None, None, 32, 1.0, None) for i in range(256)]  # the old wire format
    results["pickle_us_256_tuples"] = round(pickle_us(("step", rows, None)), 1)
    try:
        from pagedllm.engine.messages import EngineCoreOutput, Step

        outs = [EngineCoreOutput(str(i), 0, [1234], None, None, 32, 1.0, None) for i in range(256)]
        results["pickle_us_256_step_message"] = round(pickle_us(Step(outs, None)), 1)
    except ImportError:
        pass  # an older tree: its messages were the tuples above
    out = {"benchmark": "host_step", "num_requests": args.num_requests, "results": results, "label": args.label}
    out.update(environment())
    print(out)
    append_result(out, args.results_dir, "host-cpu")


if __name__ == "__main__":
    main()
