"""KV memory saved by sharing in beam search: the beam half of the vLLM paper's Fig. 15.

The workload is parallel sampling's (pagedllm/bench/sharing.py: the same arrivals, prompts and
drawn output lengths); each request runs SamplingParams(use_beam_search=True, n=W,
max_tokens=its drawn output length, ignore_eos=True) through the real Scheduler and LLMEngine
over a fake executor. Beam search asks each beam row for its top 2 x W next tokens; the fake
answers with ids and logprobs that are a deterministic function of the row's context (no model,
no torch). Its logprobs: the best is -g1, the next ones -(g1 + g2), -(g1 + g2 + g3), ..., with
the gaps g drawn from an exponential of mean 1 nat (seeded by the context). Beam search only
ranks sums of logprobs, so the scale of the gaps changes nothing; their shape is the fake's one
assumption (how often a beam's children all lose to another beam's, which is what merges beams'
histories).

With sharing: the KV blocks in use in the pool at every step once it is scheduled (beams of a
request share their prompt and common history by reference count). Without sharing: what one
contiguous copy per beam holds, each beam with its own prompt and history (HF transformers'
per-beam caches, or an engine without fork): the sum over the step's live beams of
ceil(tokens / block size), on the same steps. Both as the time average and as the peak.
"""

from __future__ import annotations

import math
import time

from pagedllm.engine import SamplingParams
from pagedllm.engine.scheduler_output import SchedulerOutput
from pagedllm.engine.step_result import StepResult, TokenLogprobs

from . import sharing

VOCAB = 30000  # fake ids are 1 .. VOCAB - 1 (0 is EOS, which the fake never proposes)
_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit function of x."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def fake_candidates(context: list[int], k: int) -> TokenLogprobs:
    """The fake model's answer after `context` (token ids): the best next token first, then the
    top k (the same best one included, as a model's log-softmax would list it), best first;
    distinct non-EOS ids, logprobs falling by exponential gaps of mean 1."""
    h = _mix(hash(tuple(context)) & _MASK)  # a tuple of ints hashes the same in every process
    first = h % (VOCAB - 1)
    ids, values, v = [], [], 0.0
    for j in range(max(k, 1)):
        h = _mix(h)
        v += math.log1p(-(h >> 11) / float(1 << 53))  # minus an Exp(1) draw
        ids.append(1 + (first + j) % (VOCAB - 1))
        values.append(v)
    return TokenLogprobs([ids[0], *ids[:k]], [values[0], *values[:k]], 1)


class BeamExecutor(sharing.StepRecorder):
    """An Executor standing for a model under beam search: every sample row gets fake_candidates
    of its context (the sampled id is the best one). Records what StepRecorder does, and the
    distinct blocks in the scheduled sequences' block tables (equal to the pool's count when
    nothing else holds blocks)."""

    def __init__(self, num_kv_blocks: int):
        super().__init__(num_kv_blocks)
        self.table_blocks: list[int] = []
        self.rows_with_logprobs = 0

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.record(out)
        self.table_blocks.append(len({b for s in out.scheduled for q in s.sample_seqs for b in q.block_table}))
        sampled: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        for s in out.scheduled:
            if not s.samples:
                continue
            for q in s.sample_seqs:
                k = q.num_logprobs  # a beam's: the search's candidates per beam (2 x W)
                if k is None:
                    sampled.append(1 + s.seq.num_tokens % (VOCAB - 1))
                    logprobs.append(None)
                    continue
                entry = fake_candidates(s.seq.token_ids, k)
                sampled.append(entry.token_ids[0])
                logprobs.append(entry)
                self.rows_with_logprobs += 1
        return StepResult(sampled, logprobs if any(x is not None for x in logprobs) else None)


def run_beam(w: sharing.Workload, width: int) -> dict:
    """The workload under beam search of `width` beams per request (its first drawn output length)."""
    lens = [o[0] for o in w.output_lens]
    blocks_per_beam = sum(-(-(len(p) + o) // sharing.BLOCK_SIZE) + 2 for p, o in zip(w.prompts, lens, strict=True))
    num_blocks = width * blocks_per_beam + 16  # a copy per beam of every request: never binds
    executor = BeamExecutor(num_blocks)
    engine = sharing.make_engine(executor, num_blocks)
    executor.engine = engine

    def add(j: int) -> None:
        params = SamplingParams(n=width, use_beam_search=True, temperature=0.0, max_tokens=lens[j], ignore_eos=True)
        engine.add_request(f"r{j}", w.prompts[j], params, stream=False)

    t0 = time.perf_counter()
    done = sharing.drive(engine, w, add)
    seconds = time.perf_counter() - t0
    m = engine.get_metrics()
    assert m["num_preemptions"] == 0 and m["num_free_kv_blocks"] == num_blocks
    assert len(done) == len(w.prompts)
    for o in done:  # every request returns its W beams, each run to max_tokens (ignore_eos)
        j = int(o.request_id[1:])
        assert len(o.outputs) == width and all(len(c.token_ids) == lens[j] for c in o.outputs), o.request_id
    used, contiguous = executor.blocks_in_use, executor.contiguous
    return {
        "steps": len(used),
        "peak_blocks": max(used),
        "mean_blocks": sum(used) / len(used),
        "peak_contiguous_blocks": max(contiguous),
        "mean_contiguous_blocks": sum(contiguous) / len(contiguous),
        "pool_equals_block_tables": used == executor.table_blocks,
        "prompt_tokens_computed": executor.prompt_tokens_computed,
        "generated_tokens": m["num_generation_tokens"],
        "forked_sequences": m["num_forked_sequences"],
        "copy_on_write_blocks": m["num_copy_on_write_blocks"],
        "seconds": round(seconds, 3),
    }


def measure_beam(dataset: str, width: int, args) -> dict:
    w = sharing.make_workload(dataset, 1, args.num_requests, args.concurrency, args.seed, args.distribution, True)
    r = run_beam(w, width)
    lo, hi = sharing.PAPER_BEAM_SAVING_PCT[dataset]
    avg_with, avg_without = r["mean_blocks"], r["mean_contiguous_blocks"]
    return {
        "dataset": dataset,
        "beam_width": width,
        "mean_prompt_len": round(sum(map(len, w.prompts)) / len(w.prompts), 1),
        "mean_output_len": round(sum(o[0] for o in w.output_lens) / len(w.prompts), 1),
        "prompt_tokens": sum(map(len, w.prompts)),
        "time_avg_blocks_without": round(avg_without, 1),
        "time_avg_blocks_with": round(avg_with, 1),
        "time_avg_saving_pct": round(100 * (1 - avg_with / avg_without), 1),
        "peak_blocks_without": r["peak_contiguous_blocks"],
        "peak_blocks_with": r["peak_blocks"],
        "peak_saving_pct": round(100 * (1 - r["peak_blocks"] / r["peak_contiguous_blocks"]), 1),
        "paper_saving_pct_w2_to_w6": f"{lo}-{hi}",
        "run": r,
    }
