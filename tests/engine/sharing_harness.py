"""Drive LLMEngine over the shadow-KV runner and check the sharing invariants at every step.

`CheckedRunner` is a ShadowRunner that, at every launch, refuses a write that changes a slot of a
block held by more than one sequence unless every holder expects exactly that (position, token)
there (same-step sharing writes what its sharers will read; a missed copy-on-write writes one
child's token under another). It also counts the tokens it executes, prompt tokens apart.
`check_state` asserts, after a step, what must hold between steps: the pool's invariants,
reference counts equal to the number of block tables holding each block, registered blocks
holding their tokens' KV.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pagedllm.engine import LLMEngine, SamplingParams, SchedulerConfig
from pagedllm.engine.scheduler_output import PLACEHOLDER, SchedulerOutput
from pagedllm.engine.sequence import Sequence, SequenceStatus
from tests.engine.fake_runner import ShadowRunner, reference_generate
from tests.engine.test_engine_equivalence import check_registered_blocks_hold_their_kv


class ExecutorFailure(RuntimeError):
    pass


class CheckedRunner(ShadowRunner):
    """ShadowRunner with the in-place-write check. `fail_at`: the launches (1-based) that raise
    before touching the shadow; `fail_result_at`: async launches that write nothing and whose result() raises."""

    def __init__(self, block_size: int, fail_at=(), fail_result_at=(), check_writes: bool = True, **kw):
        super().__init__(block_size, salt_by_seed=True, **kw)
        self.check_writes = check_writes  # False: only count (long traces)
        self.engine: LLMEngine | None = None
        self.fail_at, self.fail_result_at = set(fail_at), set(fail_result_at)
        self.launches = 0
        self.executed_tokens = 0
        self.executed_prompt_tokens = 0
        self.shared_writes = 0  # writes into blocks held by > 1 sequence (same-step sharing)
        self.final_outputs: dict = {}  # request id -> its final RequestOutput (run())

    def live_sequences(self) -> list[Sequence]:
        assert self.engine is not None
        return [s for seqs in self.engine.core.requests.values() for s in seqs]

    def _expected(self, seq: Sequence, pos: int) -> int | None:
        if pos >= seq.num_tokens:
            return None
        tok = seq.token_ids[pos]
        return self.device_tokens.get((seq.seq_id, pos)) if tok == PLACEHOLDER else tok

    def execute(self, out: SchedulerOutput):
        self.launches += 1
        if self.launches in self.fail_at:
            raise ExecutorFailure(f"launch {self.launches}")
        if not self.check_writes:
            self._count(out)
            return super().execute(out)
        bs = self.block_size
        holders: dict[int, list[Sequence]] = {}
        for s in self.live_sequences():
            for b in s.block_table:
                holders.setdefault(b, []).append(s)
        before = dict(self.shadow)
        result = super().execute(out)
        for slot, value in self.shadow.items():
            if before.get(slot) == value:
                continue
            block, off = divmod(slot, bs)
            sharers = holders.get(block, [])
            if len(sharers) > 1:
                self.shared_writes += 1
                for s in sharers:
                    pos = s.block_table.index(block) * bs + off
                    assert value == (pos, self._expected(s, pos)), (
                        f"block {block} held by {len(sharers)} sequences written in place: {value} at slot "
                        f"{slot}, {s} expects {(pos, self._expected(s, pos))}"
                    )
        self._count(out)
        return result

    def _count(self, out: SchedulerOutput) -> None:
        for sched in out.scheduled:
            a = sched.seq.num_computed_tokens
            self.executed_tokens += sched.num_new_tokens
            self.executed_prompt_tokens += max(0, min(a + sched.num_new_tokens, sched.seq.num_prompt_tokens) - a)

    def execute_async(self, out: SchedulerOutput):
        if self.launches + 1 in self.fail_result_at:  # launched, then lost: its KV writes never land
            kept = dict(self.shadow)
            super().execute_async(out)  # (its sampled ids still feed later launches, as garbage would)
            self.shadow = kept
            return FailingHandle(self.launches)
        return super().execute_async(out)


class FailingHandle:
    def __init__(self, launch: int):
        self.launch = launch

    def result(self):
        raise ExecutorFailure(f"result of launch {self.launch}")


def check_state(engine: LLMEngine, runner: CheckedRunner) -> None:
    """What holds between steps."""
    kv = engine.kv
    kv.pool.check_invariants()
    held = Counter(b for s in runner.live_sequences() for b in s.block_table)
    refs = {b.block_id: b.ref_cnt for b in kv.pool.blocks if b.ref_cnt}
    assert refs == dict(held), "ref counts != block tables holding the block"
    for s in runner.live_sequences():
        assert len(s.block_table) * kv.block_size >= s.num_computed_tokens, s
        if s.status is not SequenceStatus.RUNNING:
            assert not s.block_table, s  # waiting, preempted and not-yet-forked sequences hold nothing
    check_registered_blocks_hold_their_kv(engine, runner)


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    n: int = 1
    seed: int | None = None

    def params(self) -> SamplingParams:
        return SamplingParams(n=self.n, seed=self.seed, max_tokens=self.max_tokens, ignore_eos=True, temperature=1.0)

    def expected(self) -> list[list[int]]:
        seeds = [None if self.seed is None else self.seed + i for i in range(self.n)]
        return [reference_generate(self.prompt, self.max_tokens, s) for s in seeds]


def make_engine(
    *,
    block_size: int,
    num_kv_blocks: int = 4096,
    budget: int = 8192,
    max_num_seqs: int = 256,
    prefix: bool = True,
    async_scheduling: bool = False,
    max_model_len: int = 4096,
    **runner_kw,
) -> tuple[LLMEngine, CheckedRunner]:
    cfg = SchedulerConfig(
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_prefix_caching=prefix,
    )
    runner = CheckedRunner(block_size, num_kv_blocks=num_kv_blocks, **runner_kw)
    engine = LLMEngine(cfg, runner, async_scheduling=async_scheduling)
    assert engine.async_scheduling == async_scheduling
    runner.engine = engine
    return engine, runner


def run(
    reqs: list[Req],
    *,
    per_step: int | None = None,
    abort: dict[int, list[str]] | None = None,
    on_step=None,
    **engine_kw,
) -> tuple[dict[str, list[list[int]]], LLMEngine, CheckedRunner]:
    """Add the requests (all before the first step, or `per_step` a step), step to the end checking
    the state after every step; `abort`: step number -> request ids aborted before that step.
    Returns request id -> the token ids of each of its samples, by index (the final RequestOutputs
    are in `runner.final_outputs`)."""
    engine, runner = make_engine(**engine_kw)
    pending = list(reqs)
    results: dict[str, list[list[int]]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        for _ in range(len(pending) if per_step is None else per_step):
            if pending:
                r = pending.pop(0)
                engine.add_request(r.rid, r.prompt, r.params())
        for rid in (abort or {}).get(step, []):
            engine.abort_request(rid)
        for out in engine.step():
            if out.finished:
                assert [o.index for o in out.outputs] == list(range(len(out.outputs)))
                results[out.request_id] = [o.token_ids for o in out.outputs]
                runner.final_outputs[out.request_id] = out
        check_state(engine, runner)
        if on_step is not None:
            on_step(engine, runner, step)
        step += 1
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return results, engine, runner
