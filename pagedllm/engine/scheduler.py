"""Continuous-batching scheduler in vLLM v1's style.

Each step has a token budget (max_num_batched_tokens) and a sequence limit (max_num_seqs).
Running sequences go first: one token per decode, or the next chunk of an unfinished
prefill. Then waiting sequences are admitted (preempted ones first, they sit at the front)
while budget, sequence slots and blocks allow. When blocks run out, the most recently
admitted running sequence is preempted by recompute: its blocks are freed and it goes back
to the front of the waiting queue; on resume it re-hits its own cached prefix (a lookup the
prefix-cache statistics count apart: kv_cache_manager.PrefixCacheStats). preemption_mode="swap"
first writes its blocks to the host tier, held there until its resume loads them (host_tier.py).
With the host tier, a waiting sequence whose prefix hit continues into host memory is admitted
with no token to compute when running sequences take part in the step (it waits alone: its loads
run beside the step's forward, a prefetch, and the next step schedules it), and so are those at
the queue's head once the token budget runs out (`_prefetch`).

A scheduled sequence's full blocks are registered in the prefix cache at once, so the
sequences admitted after it in the same step, and in every later step, hit them
(kv_cache_manager.py says why that is safe). Parallel sampling: the step that computes the
last prompt token of a request with n > 1 forks its other sequences (Sequence.forks); each
samples from that step's logits row and they run on as separate sequences sharing the prompt's
blocks. A request's sequences are admitted together (they need n sequence slots) and preempted
together (those of them not yet scheduled in the step), and come back in order.

Beam search (beam_search.py decides, beam_step.py acts on the beams): a beam's step returns its
top-k instead of a token; the beam then has nothing to compute until every live beam of its
request has its result, when the search steps: a beam chosen once is extended in place, one chosen
again is forked (it shares the blocks; copy-on-write on the partial one), one not chosen is freed.
No beam carries a PLACEHOLDER: async scheduling simply skips beams that wait for their search.

Structured output (structured_output.py): a sequence with a grammar is admitted only once its
grammar is compiled (it keeps its place in the queue, the ones behind it are admitted meanwhile);
its matcher consumes each token as it is resolved, and the sequence finishes ("stop") as soon as
its grammar is complete. Forked sequences get copies of the parent's matcher; a preempted one
keeps its matcher (its outputs are kept); a finished one drops it.

Speculative decoding (spec_decode.py, spec_verify.py): a decoding sequence may get proposals;
it is scheduled for 1 + k' tokens, samples 1 + k' rows, and resolve keeps the accepted run,
rolls its computed length and blocks back, and checks the stop conditions token by token.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from pagedllm.engine.beam_search import BeamSearch
from pagedllm.engine.beam_step import keep_beam_result, next_beams
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.scheduler_output import PLACEHOLDER, ScheduledSequence, SchedulerOutput
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.engine.spec_decode import Speculator
from pagedllm.engine.spec_verify import verify
from pagedllm.engine.step_result import StepResult, TokenLogprobs
from pagedllm.engine.stop_conditions import stop_status

logger = logging.getLogger("pagedllm")

# a sequence that got tokens in a step: the tokens (several after an accepted speculative run) and
# per token its logprobs where any row of the step asked (each None where its own row did not)
Resolved = tuple[Sequence, list[int], list[TokenLogprobs | None] | None]

__all__ = ["PLACEHOLDER", "ScheduledSequence", "Scheduler", "SchedulerOutput"]


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        preemption_mode: str = "recompute",
        speculator: Speculator | None = None,
    ):
        # preconditions, not validation: SchedulerConfig.__post_init__ refused non-positive sizes at the edge
        assert max_num_seqs >= 1 and max_num_batched_tokens >= 1, (max_num_seqs, max_num_batched_tokens)
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.preemption_mode = preemption_mode  # "recompute" or "swap" (SchedulerConfig checked it)
        self.num_swapped_out_sequences = 0  # preempted with at least one block held in the host tier
        self._preempted_at: dict[int, float] = {}  # seq_id -> when it was preempted (until resumed)
        self.preempted_wait_s, self.num_resumed = 0.0, 0  # summed time from preemption to resume (s), resumes
        self.num_forked_sequences = 0  # children forked by parallel sampling (a counter, for metrics)
        # ended (finish_reason "error") by a grammar that failed to compile, and why
        self.grammar_failed: list[tuple[Sequence, str]] = []
        self.speculator = speculator  # speculative decoding (spec_decode.py): proposals for decodes

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        forked: list[Sequence] = []
        spec = (
            self.speculator if self.speculator is not None and self.speculator.start_step(len(self.running)) else None
        )
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            # async, a token in flight: a sequence at its length finishes when the token arrives; one
            # whose next logits depend on its past tokens (penalties, a bad word of several tokens, a
            # grammar's mask: SamplingParams.needs_output_history) waits for it, it must see the token
            if (seq.num_pending and (seq.needs_history or self.reached_length(seq))) or (
                num_new == 0  # a beam waiting for its search
            ):
                i += 1
                continue
            drafts = spec.propose(seq, budget, self.kv) if spec is not None and num_new == 1 else []
            num_new += len(drafts)  # their slots are allocated: the call below only confirms it
            while not self.kv.allocate_slots(seq, num_new):
                victims = self._preempt_group(self.running[-1].request_id, out)
                out.num_preempted += len(victims)
                if seq in victims:
                    break
            else:
                self._scheduled(out, ScheduledSequence(seq, num_new, spec_token_ids=drafts), forked)
                budget -= num_new
                i += 1
                continue
            break  # seq itself was preempted: everything after it already was
        if out.num_preempted == 0:
            budget = self._admit(out, budget, forked)
            if budget == 0:  # something was scheduled
                self._prefetch(forked)
            if not out.scheduled and self.waiting:
                # every running sequence is a beam waiting for its search while the queue's head
                # cannot get blocks: free the newest other search, or nothing would ever move
                head = self.waiting[0].request_id
                others = [s for s in self.running if s.request_id != head]
                if others:
                    out.num_preempted += len(self._preempt_group(others[-1].request_id, out))
                    self._admit(out, budget, forked)
        if spec is not None:
            spec.end_step()
        self.running += forked
        out.blocks_to_copy = self.kv.take_blocks_to_copy()
        if out.scheduled:  # a step that launches nothing keeps its copies for the next one
            t = self.kv.take_transfers()
            out.blocks_to_offload, out.blocks_to_load, out.blocks_to_prefetch = t.offloads, t.loads, t.prefetches
            out.new_host_cached = t.new_host_cached
            out.new_cached += t.loaded
        return out

    def _admit(self, out: SchedulerOutput, budget: int, forked: list[Sequence]) -> int:
        """Admit waiting sequences, in order, while budget, sequence slots and blocks allow."""
        if not self.waiting:
            return budget  # the common decode step: no pass over the running sequences' slots
        slots = len(self.running) + len(forked) + sum(self._reserved(s) - 1 for s in self.running)
        compiling: list[Sequence] = []  # grammars still compiling: they keep their place in the queue
        # running sequences take part in this step: a host-tier load must not hold them up
        others_run = bool(out.scheduled)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.grammar is not None and not seq.grammar.ready():
                compiling.append(self.waiting.popleft())
                continue
            if seq.grammar is not None and seq.grammar.error is not None:
                self._grammar_failed(seq)
                continue
            if slots + self._reserved(seq) > self.max_num_seqs:
                break
            computed = self.kv.get_computed_blocks(seq)
            if others_run and self.kv.hit_waits_for_load(computed):
                # its loads run beside this step's forward; it computes from the next step on
                if not self.kv.allocate_slots(seq, 0, computed, prefetch=True):
                    break
                self._start(seq)
                slots += self._reserved(seq)
                continue
            num_new = min(seq.num_tokens - computed.num_blocks * self.kv.block_size, budget)
            if not self.kv.allocate_slots(seq, num_new, computed):
                break
            self._start(seq)
            slots += self._reserved(seq)
            self._scheduled(out, ScheduledSequence(seq, num_new), forked)
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))
        return budget

    def _start(self, seq: Sequence) -> None:
        """The queue's head joins the running sequences (it holds its blocks from now on)."""
        self.waiting.popleft()
        if (preempted_at := self._preempted_at.pop(seq.seq_id, None)) is not None:
            self.preempted_wait_s, self.num_resumed = (
                self.preempted_wait_s + time.monotonic() - preempted_at,
                self.num_resumed + 1,
            )
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _prefetch(self, forked: list[Sequence]) -> None:
        """The token budget ran out with sequences still waiting. If some at the queue's head (as
        many as the next step's budget covers) hit prefixes in the host tier, they and the ones
        before them are admitted now, in queue order, with no token to compute: they take their
        blocks, and their loads run as this step's prefetch beside its forward (host_kv_cache.py),
        so the next step schedules them without waiting for PCIe. A sequence with a grammar ends
        the look-ahead (it may still be compiling: _admit decides when it starts)."""
        if not self.kv.has_host_tier:
            return
        slots = len(self.running) + len(forked) + sum(self._reserved(s) - 1 for s in self.running)
        ahead, count, last = self.max_num_batched_tokens, 0, 0
        for seq in self.waiting:  # lookups only: nothing is taken yet
            slots += self._reserved(seq)
            if ahead <= 0 or seq.grammar is not None or slots > self.max_num_seqs:
                break
            computed = self.kv.get_computed_blocks(seq)
            ahead -= seq.num_tokens - computed.num_blocks * self.kv.block_size
            count += 1
            if self.kv.hit_loads_from_host(computed):
                last = count
        for _ in range(last):
            seq = self.waiting[0]
            if not self.kv.allocate_slots(seq, 0, self.kv.get_computed_blocks(seq), prefetch=True):
                break
            self._start(seq)

    def _grammar_failed(self, seq: Sequence) -> None:
        """The edge compiled the grammar over the same tokenizer (grammar.GrammarChecker), so this
        is rare (an engine used without its InputProcessor): the request ends with finish_reason
        "error" and llguidance's message, never as an empty answer."""
        assert seq.grammar is not None
        logger.error("request %s: its grammar failed to compile: %s", seq.request_id, seq.grammar.error)
        error = str(seq.grammar.error)
        group = [*seq.forks, seq]
        for s in group:
            self.finish(s, SequenceStatus.FINISHED_ERROR)
        self.grammar_failed += [(s, error) for s in group]

    @staticmethod
    def _reserved(seq: Sequence) -> int:
        """Sequence slots a sequence stands for: itself, the children it will fork, and for the
        first beam of a search that has not stepped yet, the beams it will become."""
        if seq.beam is not None and len(seq.beam.beams) == 1:
            return seq.beam.width
        return 1 + len(seq.forks)

    def _scheduled(self, out: SchedulerOutput, sched: ScheduledSequence, forked: list[Sequence]) -> None:
        """Register the blocks the step fills, and fork the children of a first sample."""
        seq = sched.seq
        out.new_cached += self.kv.cache_full_blocks(seq, seq.num_computed_tokens + sched.num_new_tokens)
        if seq.forks and sched.samples:
            for child in seq.forks:
                self.kv.fork(seq, child)
                if seq.grammar is not None:
                    child.grammar = seq.grammar.fork()
                child.fork_parent = None
                child.status = SequenceStatus.RUNNING
            sched.forks, seq.forks = seq.forks, []
            forked += sched.forks
            self.num_forked_sequences += len(sched.forks)
        out.scheduled.append(sched)

    def _preempt_group(self, request_id: str, out: SchedulerOutput) -> list[Sequence]:
        """Preempt a request's running sequences, all but those already scheduled in this step
        (parallel samples, the beams of a search, waiting ones included); returns them."""
        scheduled = {id(x.seq) for x in out.scheduled}
        group = [s for s in self.running if s.request_id == request_id and id(s) not in scheduled]
        gone = {id(s) for s in group}
        self.running = [s for s in self.running if id(s) not in gone]
        for seq in reversed(group):  # appendleft: the request's order at the queue's front
            self._preempt(seq)
        return group

    def _preempt(self, seq: Sequence) -> None:
        if self.preemption_mode == "swap" and self.kv.swap_out(seq):
            self.num_swapped_out_sequences += 1
        self.kv.free(seq)
        self._preempted_at[seq.seq_id] = time.monotonic()
        seq.beam_result = None  # a beam recomputes its last token, and its top-k with it
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, out: SchedulerOutput, result: StepResult) -> list[Resolved]:
        """Apply one step's results (synchronous scheduling): advance, then resolve at once."""
        self.advance(out)
        return self.resolve(out, result)

    def advance(self, out: SchedulerOutput) -> None:
        """At launch: advance computed counts and give every sampling sequence a PLACEHOLDER
        token, so the next step can be scheduled before the sampled ids reach the host (async
        scheduling). The next step's input for that token is taken from the device."""
        for sched in out.scheduled:
            seq = sched.seq
            sched.sampled = sampled = sched.samples
            if sched.forks:
                for s in sched.sample_seqs:  # a child forked here starts from the parent's count
                    s.num_computed_tokens += sched.num_new_tokens
            else:  # the common row: one sequence (this loop runs for every sequence of every step)
                seq.num_computed_tokens += sched.num_new_tokens
            sched.computed_after = seq.num_computed_tokens
            if not sampled or seq.beam is not None:
                continue  # a beam's next token is its search's choice (resolve)
            sched.placeholder_index = len(seq.token_ids)
            for s in sched.sample_seqs:
                s.token_ids.append(PLACEHOLDER)
                s.num_pending += 1

    def resolve(
        self, out: SchedulerOutput, result: StepResult, inflight: SchedulerOutput | None = None
    ) -> list[Resolved]:
        """When the step's results arrive: fill the placeholders (one per sample row, in row
        order), keep prompt logprobs, register the blocks whose ids are now known, stop on EOS /
        stop token ids. Returns the sequences that got a token (finished or not), each with the
        token's logprobs (None when it asked for none).

        `inflight` (async scheduling): the step launched since `out`. A block completed by a
        resolved token is written by that step (the token is its input), so the block joins its
        `new_cached`: uncached with it if it never runs."""
        now = time.monotonic()
        sampled = result.sampled
        rows = iter(range(len(sampled)))
        logprobs = result.logprobs
        touched: list[Resolved] = []
        if result.prompt_logprobs:
            self._keep_prompt_logprobs(out, result)
        searches: dict[int, BeamSearch[Sequence]] = {}
        for sched in out.scheduled:
            if not sched.sampled:
                continue
            if sched.seq.beam is not None:
                keep_beam_result(sched.seq, result, next(rows), now, searches)
                continue
            idx = sched.placeholder_index
            drafts = sched.spec_token_ids
            for seq in sched.sample_seqs:
                taken = [next(rows) for _ in range(1 + len(drafts))] if drafts else [next(rows)]
                if idx >= len(seq.token_ids):  # finished or preempted after this step launched: never emitted
                    out.num_rejected_tokens += len(taken)
                    continue
                if drafts:  # resolved before the next step is scheduled (core.py): the accepted run, rolled back
                    assert self.speculator is not None and seq.status is SequenceStatus.RUNNING
                    tokens = verify(seq, drafts, [sampled[r] for r in taken], self.kv, self.speculator)
                    seq.token_ids[idx : idx + 1] = tokens
                else:
                    tokens = [sampled[taken[0]]]
                    seq.token_ids[idx] = tokens[0]
                seq.num_pending -= 1
                if seq.first_token_time is None:
                    seq.first_token_time = now
                status = None
                for n, token in enumerate(tokens):  # stop inside an accepted run: the rest is dropped
                    status = stop_status(seq, token, idx + n + 1, self.eos_token_ids, self.max_model_len)
                    if status is not None:
                        del seq.token_ids[idx + n + 1 : idx + len(tokens)]
                        tokens = tokens[: n + 1]
                        break
                out.num_rejected_tokens += len(taken) - len(tokens)
                if seq.status is SequenceStatus.RUNNING:
                    registered = self.kv.cache_full_blocks(seq, seq.num_computed_tokens)
                    if inflight is not None:
                        inflight.new_cached += registered
                if status is not None:
                    self.finish(seq, status, now)
                row_logprobs = None if logprobs is None else [logprobs[r] for r in taken[: len(tokens)]]
                touched.append((seq, tokens, row_logprobs))
        for search in searches.values():
            if all(b.beam_result is not None for b in search.beams):
                self._step_search(search, out)
        return touched

    def _step_search(self, search: BeamSearch[Sequence], out: SchedulerOutput) -> None:
        """Every live beam has its top-k: its next beams run, the ones not chosen are freed (beam_step.py)."""
        forks, dropped = next_beams(search, self.kv)
        self.running += forks
        self.num_forked_sequences += len(forks)
        for parent in dropped:
            self.finish(parent, SequenceStatus.FINISHED_STOPPED)
        if search.done:
            out.finished_searches.append(search)

    @staticmethod
    def _keep_prompt_logprobs(out: SchedulerOutput, result: StepResult) -> None:
        """Append each chunk to its sequence's prompt logprobs (a resumed sequence recomputes
        what it already has: only the entries past those are kept)."""
        assert result.prompt_logprobs is not None
        for sched in out.scheduled:
            seq = sched.seq
            chunk = result.prompt_logprobs.get(seq.seq_id)
            if chunk is None:
                continue
            have = len(seq.prompt_logprobs) + 1  # the prompt index of the next entry it needs
            skip = have - chunk.start
            if 0 <= skip < len(chunk.entries):
                seq.prompt_logprobs += chunk.entries[skip:]

    def reached_length(self, seq: Sequence) -> bool:
        """Its last (possibly pending) token is the last allowed: nothing more to schedule. (Asked of
        every running sequence at every step under async scheduling: lengths read directly.)"""
        n = len(seq.token_ids)
        return n - seq.num_prompt_tokens >= seq.sampling_params.max_tokens or n >= self.max_model_len

    def finish(self, seq: Sequence, status: SequenceStatus, now: float | None = None) -> None:
        """End a sequence wherever it is and free its blocks now."""
        if seq.status.finished:
            return
        if seq.fork_parent is not None:  # a child not forked yet: it holds nothing
            seq.fork_parent.forks.remove(seq)
            seq.fork_parent = None
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._preempted_at.pop(seq.seq_id, None)
        self.kv.free(seq)
        seq.grammar = None
        if seq.num_pending:  # tokens of a step launched meanwhile: never sampled
            del seq.token_ids[-seq.num_pending :]
            seq.num_pending = 0
        seq.status = status
        seq.finish_time = time.monotonic() if now is None else now
