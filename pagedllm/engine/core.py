"""EngineCore: checked requests in, token ids out, one `step()` at a time (no tokenizer).

The core owns the scheduler and the KV-cache manager (the single truth for block ids and
prefix hashes) and drives an executor (executor.py). A step returns one EngineCoreOutput per
sequence that got a token, in scheduled order. Text, stop strings and RequestOutputs are the
output processor's (output_processor.py), which runs on top of the core in LLMEngine and in the
API process of the server, where this core runs in a process of its own (entrypoints/engine_core.py).

Requests come from InputProcessor.process, so the core asserts their preconditions instead of
checking them again; the refusals it can still make are a request id already in use and a
structured-output request to a core that was given no grammar tokenizer.

Structured output: the core owns the StructuredOutputManager (structured_output.py); a
request's first sequence gets its grammar here, compiled in the background while it waits.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING

from pagedllm.engine.beam_search import BeamSearch
from pagedllm.engine.config import SchedulerConfig
from pagedllm.engine.core_metrics import core_metrics
from pagedllm.engine.core_outputs import beam_outputs, grammar_failure_output, token_output
from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.executor import Executor, StepHandle
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest, Metrics
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.scheduler import Resolved, Scheduler, SchedulerOutput
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.engine.spec_decode import Speculator
from pagedllm.engine.spec_draft import drafter_of, fill_drafts
from pagedllm.engine.timeline import Timeline
from pagedllm.engine.trace import Tracer

if TYPE_CHECKING:
    from llguidance import LLTokenizer

    from pagedllm.engine.structured_output import StructuredOutputManager


class EngineCore:
    def __init__(
        self,
        config: SchedulerConfig,
        executor: Executor,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        trace_sink: IO[str] | list[dict[str, object]] | None = None,
        async_scheduling: bool = False,
        grammar_tokenizer: Callable[[], LLTokenizer] | None = None,
    ):
        """grammar_tokenizer: builds llguidance's tokenizer over the model's vocabulary (called
        once, on the first structured-output request); None: such requests are refused."""
        self.config = config
        self.executor = executor
        tracer = Tracer(trace_sink) if config.trace_blocks else None
        self.kv = KVCacheManager(
            config.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            tracer,
            hash_algo=config.prefix_caching_hash_algo,  # hash_seed: a secret of this process
            groups=executor.kv_cache_groups,
            num_host_blocks=config.num_host_kv_blocks,
        )
        spec = config.speculative_config
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            eos_token_ids,
            config.preemption_mode,
            None if spec is None else Speculator(spec, config.max_model_len),
        )
        self.drafter = drafter_of(executor, spec)  # a draft model's proposals (spec_draft.py), else None
        # step N+1 is launched before step N's ids are on the host (needs an executor that offers it);
        # a step that proposes (speculative decoding) runs synchronously: _step_async
        self.async_scheduling = async_scheduling and executor.supports_async
        self.requests: dict[str, list[Sequence]] = {}  # unfinished: request id -> its sequences, by index
        self._index: dict[int, int] = {}  # seq_id -> the sequence's index in its request
        self._inflight: tuple[SchedulerOutput, StepHandle] | None = None  # async: launched, not yet resolved
        self._beam_first: dict[str, Sequence] = {}  # beam search: the request's first sequence (its prompt's)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._grammar_tokenizer = grammar_tokenizer
        self.structured_output: StructuredOutputManager | None = None  # made on the first such request
        self.timeline: Timeline | None = None  # PAGEDLLM_TIMELINE: each step's schedule, launch and resolve times
        self._step_id = 0
        self.kv_load_seconds = 0.0  # device time of host-tier loads, as the executor measured it (a counter)

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a checked request: params.num_samples sequences (seeds seed, seed+1, ... when more
        than one). Only the first is queued; the scheduler forks the others from it when its
        prompt is computed (parallel sampling, scheduler.py)."""
        rid = request.request_id
        self.check_new_request_id(rid)
        params, ids = request.params, request.prompt_token_ids
        assert isinstance(params, SamplingParams), "InputProcessor.process checks the params"
        assert 0 < len(ids) < self.config.max_model_len, "InputProcessor.process checks the prompt length"
        if params.use_beam_search:
            if self.config.speculative_config is not None:
                raise InvalidRequestError(
                    "beam search cannot run with speculative decoding (speculative_config)", "use_beam_search"
                )
            self._add_beam_search(rid, ids, params, request.arrival_time)
            return
        so = params.structured_outputs
        grammar = None if so is None else self._grammar_manager().grammar_for(so)  # may refuse: before any change
        num = params.num_samples
        seqs = []
        for i in range(num):
            p = params
            if num > 1:
                # one sample per sequence, drawn with seed + i (SamplingParams checked seed + num - 1);
                # only the first computes the prompt, so only it keeps prompt_logprobs
                seed = None if params.seed is None else params.seed + i
                p = dataclasses.replace(
                    params,
                    seed=seed,
                    n=1,
                    best_of=None,
                    logprobs=params.sample_logprobs,  # best_of ranks the samples by cumulative logprob
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None,
                )
            seq = Sequence(rid, ids, p, request.arrival_time)
            self._index[seq.seq_id] = i
            seqs.append(seq)
        self.requests[rid] = seqs
        # waves of at most max_num_seqs samples (the scheduler admits a wave's sequences together):
        # each wave's first sequence computes the prompt, from the blocks the wave before it left in
        # the prefix cache when it is on, and forks the others at its last prompt token
        wave = self.config.max_num_seqs
        for start in range(0, num, wave):
            parent = seqs[start]
            if start == 0:
                parent.grammar = grammar  # the forks get copies of it when they fork (scheduler.py)
            elif so is not None:
                parent.grammar = self._grammar_manager().grammar_for(so)
            parent.forks = seqs[start + 1 : start + wave]
            for child in parent.forks:
                child.fork_parent = parent
            self.scheduler.add(parent)

    def _add_beam_search(self, rid: str, ids: list[int], params: SamplingParams, arrival_time: float) -> None:
        """One sequence computes the prompt; the search grows it into params.n beams (scheduler.py).
        The request's entry is the search's list of live beams."""
        seq = Sequence(rid, ids, params, arrival_time)
        search = BeamSearch[Sequence](rid, params, self.scheduler.eos_token_ids)
        seq.beam, seq.num_logprobs = search, search.num_candidates
        search.beams.append(seq)
        self.requests[rid] = search.beams
        self._beam_first[rid] = seq
        self.scheduler.add(seq)

    def _grammar_manager(self) -> StructuredOutputManager:
        if self._grammar_tokenizer is None:
            raise InvalidRequestError(
                "structured_outputs needs a tokenizer, and this engine has none", "structured_outputs"
            )
        if self.structured_output is None:
            from pagedllm.engine.structured_output import StructuredOutputManager

            self.structured_output = StructuredOutputManager(self._grammar_tokenizer, self.scheduler.eos_token_ids)
        return self.structured_output

    def check_new_request_id(self, request_id: str) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", "request_id")

    def abort_request(self, request_id: str) -> bool:
        """Finish a request at once, wherever it is; its blocks are free when this returns."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return False
        for seq in seqs:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            self._index.pop(seq.seq_id, None)
        self._beam_first.pop(request_id, None)
        return True

    def stop_sequence(self, request_id: str, index: int) -> None:
        """The output processor found a stop string in this sequence's text: finish it now."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return
        self.scheduler.finish(seqs[index], SequenceStatus.FINISHED_STOPPED)
        self._forget_if_done(request_id)

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._inflight is not None

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute, update. With async scheduling the step launched here runs on the
        device while the previous step's ids are resolved, so outputs lag one launch behind.

        A step that raises never ran (or not to the end): the blocks registered when it (and,
        async, the step launched after it) was scheduled are uncached before the error goes on."""
        if self.async_scheduling:
            return self._step_async()
        t0 = time.monotonic()
        sched = self.scheduler.schedule()
        if not sched:
            return self._grammar_failures()
        try:
            if self.drafter is not None:
                fill_drafts(sched, self.drafter)
            result = self.executor.execute(sched)
            self.kv_load_seconds += result.kv_load_seconds
        except BaseException:
            self.kv.uncache(sched.new_cached, sched.new_host_cached)
            raise
        if self.timeline is not None:
            step = self._note_launch(sched, t0)
            self.timeline.event("resolve", step=step)
        touched = self.scheduler.update(sched, result)
        outputs = self._outputs(touched, sched, len(result.sampled))
        return self._grammar_failures() + outputs

    def _step_async(self) -> list[EngineCoreOutput]:
        drained: list[EngineCoreOutput] = []
        if self._inflight is not None and (_history_bound(self._inflight[0]) or self._speculating(self._inflight[0])):
            drained = self._resolve_inflight()
        return drained + self._launch_and_resolve()

    def _resolve_inflight(self) -> list[EngineCoreOutput]:
        """Wait for the step in flight and apply it before scheduling the next: a synchronous step,
        taken when most of its rows need their new token before they can run again (_history_bound);
        otherwise they would sit out the next step and the batch would alternate between halves."""
        assert self._inflight is not None
        prev, handle = self._inflight
        try:
            result = handle.result()
            self.kv_load_seconds += result.kv_load_seconds
            touched = self.scheduler.resolve(prev, result)
            outputs = self._outputs(touched, prev, len(result.sampled))
        except BaseException:
            self.kv.uncache(prev.new_cached, prev.new_host_cached)
            self._inflight = None
            raise
        self._inflight = None
        if self.timeline is not None:
            self.timeline.event("resolve", step=prev.step_id)
        return outputs

    def _speculating(self, inflight: SchedulerOutput) -> bool:
        """Speculative decoding under async scheduling: the step in flight is resolved before the
        next is scheduled when it verifies proposals (its accepted lengths decide where its
        sequences go on) or when the next step proposes (a proposal needs every token resolved).
        While speculation is paused (spec_decode.Backoff) steps run ahead as usual."""
        spec = self.scheduler.speculator
        return spec is not None and (
            spec.may_propose(len(self.scheduler.running)) or any(s.spec_token_ids for s in inflight.scheduled)
        )

    def _note_launch(self, sched: SchedulerOutput, t0: float) -> int:
        """Timeline: this step's rows (request, new tokens) with its schedule start and launch times."""
        assert self.timeline is not None
        self._step_id += 1
        rows = [[s.seq.request_id, s.num_new_tokens] for s in sched.scheduled]
        self.timeline.event("launch", step=self._step_id, t_sched=t0, rows=rows)
        return self._step_id

    def _launch_and_resolve(self) -> list[EngineCoreOutput]:
        t0 = time.monotonic()
        sched = self.scheduler.schedule()
        launched = None
        try:
            if sched:
                if self.drafter is not None:
                    fill_drafts(sched, self.drafter)
                launched = (sched, self.executor.execute_async(sched))
                self.scheduler.advance(sched)
                if self.timeline is not None:
                    sched.step_id = self._note_launch(sched, t0)
            outputs: list[EngineCoreOutput] = []
            if self._inflight is not None:
                prev, handle = self._inflight
                result = handle.result()
                self.kv_load_seconds += result.kv_load_seconds
                if self.timeline is not None:
                    self.timeline.event("resolve", step=prev.step_id)
                touched = self.scheduler.resolve(prev, result, sched)
                outputs = self._outputs(touched, prev, len(result.sampled))
            outputs = self._grammar_failures() + outputs
        except BaseException:
            for failed in (self._inflight[0] if self._inflight else None, sched):
                if failed is not None:
                    self.kv.uncache(failed.new_cached, failed.new_host_cached)
            self._inflight = None
            raise
        self._inflight = launched
        return outputs

    def _outputs(
        self,
        touched: list[Resolved],
        step: SchedulerOutput,
        num_sampled: int,
    ) -> list[EngineCoreOutput]:
        """The outputs of a resolved step's touched sequences and finished searches; its sampled rows,
        less those thrown away (rejected proposals' rows), count as generation tokens."""
        self.num_generation_tokens += num_sampled - step.num_rejected_tokens
        outputs = []
        done: list[str] = []
        for seq, tokens, logprobs in touched:
            index = self._index.get(seq.seq_id)
            if index is None:
                continue  # aborted while its step ran
            first = seq.num_resolved_output_tokens == len(tokens)
            if first and index == 0:
                self.num_prompt_tokens += seq.num_prompt_tokens
            outputs.append(token_output(seq, index, tokens, logprobs, first))  # core_outputs.py
            if seq.status.finished:
                done.append(seq.request_id)
        for rid in done:
            self._forget_if_done(rid)
        for search in step.finished_searches:
            outputs += self._beam_outputs(search)
        return outputs

    def _grammar_failures(self) -> list[EngineCoreOutput]:
        """Sequences the scheduler ended because their grammar failed to compile (one output each)."""
        if not self.scheduler.grammar_failed:
            return []
        failed, self.scheduler.grammar_failed = self.scheduler.grammar_failed, []
        outputs = []
        for seq, why in failed:
            index = self._index.get(seq.seq_id)
            if index is None:
                continue
            outputs.append(grammar_failure_output(seq, index, why))
        for rid in {s.request_id for s, _ in failed}:
            self._forget_if_done(rid)
        return outputs

    def _beam_outputs(self, search: BeamSearch[Sequence]) -> list[EngineCoreOutput]:
        """A finished search's outputs: one per returned hypothesis, best first (index = rank)."""
        first = self._beam_first.pop(search.request_id, None)
        if first is None:
            return []  # aborted meanwhile
        del self.requests[search.request_id]
        self.num_prompt_tokens += first.num_prompt_tokens
        return beam_outputs(search, first)

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self.requests.get(request_id)
        if seqs is not None and all(s.status.finished for s in seqs):
            del self.requests[request_id]
            for s in seqs:
                self._index.pop(s.seq_id, None)

    # ---- metrics -----------------------------------------------------------------------
    def get_metrics(self) -> Metrics:
        """Gauges and counters by name (core_metrics.py)."""
        return core_metrics(self)


def _history_bound(step: SchedulerOutput) -> bool:
    """At least half of the step's sampling rows need their token before their next step (they
    use penalties, a grammar or a multi-token bad word: Sequence.needs_history)."""
    n = sum(1 for s in step.scheduled if s.sampled and s.seq.needs_history)
    return n > 0 and 2 * n >= len(step.scheduled)
