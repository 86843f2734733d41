"""Continuous-batching scheduler in vLLM v1's style.

Each step has a token budget (max_num_batched_tokens) and a sequence limit (max_num_seqs).
Running sequences go first: one token per decode, or the next chunk of an unfinished
prefill. Then waiting sequences are admitted (preempted ones first, they sit at the front)
while budget, sequence slots and blocks allow. When blocks run out, the most recently
admitted running sequence is preempted by recompute: its blocks are freed and it goes back
to the front of the waiting queue; on resume it re-hits its own cached prefix.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last token, so a new one is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)   # since the last step: drop their state
    num_preempted: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_decode_only(self) -> bool:
        return all(s.num_new_tokens == 1 for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: set[int] | frozenset[int] = frozenset()):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._finished_seq_ids: list[int] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new
                i += 1
                continue
            break   # seq itself was preempted: everything after it already was
        if out.num_preempted == 0:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                computed = self.kv.get_computed_blocks(seq)
                num_new = min(seq.num_tokens - len(computed) * self.kv.block_size, budget)
                if not self.kv.allocate_slots(seq, num_new, computed):
                    break
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new
        out.blocks_to_copy = self.kv.take_blocks_to_copy()
        out.finished_seq_ids, self._finished_seq_ids = self._finished_seq_ids, []
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, out: SchedulerOutput, sampled: list[int]) -> list[Sequence]:
        """Apply one step's results: advance computed tokens, register full blocks, append the
        sampled tokens (one per sampling sequence, in scheduled order), finish what stopped.
        Returns the sequences that got a token or finished."""
        now = time.monotonic()
        it = iter(sampled)
        touched: list[Sequence] = []
        for sched in out.scheduled:
            seq = sched.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue                                   # aborted while the step ran
            samples = sched.samples
            seq.num_computed_tokens += sched.num_new_tokens
            self.kv.cache_full_blocks(seq)
            if not samples:
                continue
            token = next(it)
            seq.append_token(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            status = self.check_stop(seq, token)
            if status is not None:
                self.finish(seq, status, now)
            touched.append(seq)
        return touched

    def check_stop(self, seq: Sequence, token: int) -> SequenceStatus | None:
        p = seq.sampling_params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.stop_reason = None
                return SequenceStatus.FINISHED_STOPPED
            if p.stop_token_ids and token in p.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def finish(self, seq: Sequence, status: SequenceStatus, now: float | None = None) -> None:
        """End a sequence wherever it is and free its blocks now."""
        if seq.status.finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        self._finished_seq_ids.append(seq.seq_id)
        seq.status = status
        seq.finish_time = time.monotonic() if now is None else now
