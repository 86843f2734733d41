"""Continuous-batching scheduler in vLLM v1's style.

Each step has a token budget (max_num_batched_tokens) and a sequence limit (max_num_seqs).
Running sequences go first: one token per decode, or the next chunk of an unfinished
prefill. Then waiting sequences are admitted (preempted ones first, they sit at the front)
while budget, sequence slots and blocks allow. When blocks run out, the most recently
admitted running sequence is preempted by recompute: its blocks are freed and it goes back
to the front of the waiting queue; on resume it re-hits its own cached prefix (a lookup the
prefix-cache statistics count apart: kv_cache_manager.PrefixCacheStats).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.sequence import Sequence, SequenceStatus

PLACEHOLDER = -1  # a sampled token whose id has not reached the host yet (async scheduling)


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    # set by Scheduler.advance() at launch
    sampled: bool = False
    computed_after: int = 0
    placeholder_index: int = -1

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last token, so a new one is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
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
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
    ):
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

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending and self.reached_length(seq):
                i += 1  # async: finishes when its last token arrives
                continue
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
            break  # seq itself was preempted: everything after it already was
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
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, out: SchedulerOutput, sampled: list[int]) -> list[Sequence]:
        """Apply one step's results (synchronous scheduling): advance, then resolve at once."""
        self.advance(out)
        return self.resolve(out, sampled)

    def advance(self, out: SchedulerOutput) -> None:
        """At launch: advance computed counts and give every sampling sequence a PLACEHOLDER
        token, so the next step can be scheduled before the sampled ids reach the host (async
        scheduling). The next step's input for that token is taken from the device."""
        for sched in out.scheduled:
            seq = sched.seq
            sched.sampled = sched.samples
            seq.num_computed_tokens += sched.num_new_tokens
            sched.computed_after = seq.num_computed_tokens
            if not sched.sampled:
                continue
            sched.placeholder_index = seq.num_tokens
            seq.append_token(PLACEHOLDER)
            seq.num_pending += 1

    def resolve(self, out: SchedulerOutput, sampled: list[int]) -> list[Sequence]:
        """When the step's sampled ids arrive: fill the placeholders (one per sampling sequence,
        in scheduled order), register the blocks now known written, stop on EOS / stop token
        ids. Returns the sequences that got a token (finished or not)."""
        now = time.monotonic()
        it = iter(sampled)
        touched: list[Sequence] = []
        for sched in out.scheduled:
            seq = sched.seq
            if seq.status is SequenceStatus.RUNNING:
                seq.num_written = max(seq.num_written, sched.computed_after)
            if not sched.sampled:
                self.kv.cache_full_blocks(seq)
                continue
            token = next(it)
            idx = sched.placeholder_index
            if idx >= seq.num_tokens:
                continue  # finished (abort, stop) after this step launched
            seq.token_ids[idx] = token
            seq.num_pending -= 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            self.kv.cache_full_blocks(seq)
            status = self.check_stop(seq, token, idx + 1)
            if status is not None:
                self.finish(seq, status, now)
            touched.append(seq)
        return touched

    def check_stop(self, seq: Sequence, token: int, num_tokens: int) -> SequenceStatus | None:
        """Stop after `token`, the sequence's num_tokens-th token? EOS and stop token ids first
        (once min_tokens are out), then max_tokens and max_model_len."""
        p = seq.sampling_params
        num_output = num_tokens - seq.num_prompt_tokens
        if num_output >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.stop_reason = None
                return SequenceStatus.FINISHED_STOPPED
            if p.stop_token_ids and token in p.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
        if num_output >= p.max_tokens or num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def reached_length(self, seq: Sequence) -> bool:
        """Its last (possibly pending) token is the last allowed: nothing more to schedule."""
        return seq.num_output_tokens >= seq.sampling_params.max_tokens or seq.num_tokens >= self.max_model_len

    def finish(self, seq: Sequence, status: SequenceStatus, now: float | None = None) -> None:
        """End a sequence wherever it is and free its blocks now."""
        if seq.status.finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        if seq.num_pending:  # tokens of a step launched meanwhile: never sampled
            del seq.token_ids[-seq.num_pending :]
            seq.num_pending = 0
        seq.status = status
        seq.finish_time = time.monotonic() if now is None else now
