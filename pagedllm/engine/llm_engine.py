"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

The engine owns the scheduler and the KV-cache manager (the single truth for block ids and
prefix hashes) and drives an executor, anything with `execute(SchedulerOutput) -> list[int]`
returning one sampled token id per scheduled sequence that samples, in scheduled order.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedllm.engine.config import SchedulerConfig
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.engine.trace import Tracer


class Executor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> list[int]: ...


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer | None]
    emitted: list[int] = field(default_factory=list)  # chars of text already streamed, per seq
    stream: bool = True  # False: one output when finished, text decoded once unless stop strings need it


class LLMEngine:
    def __init__(
        self,
        config: SchedulerConfig,
        executor: Executor,
        tokenizer: Any = None,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        vocab_size: int | None = None,
        trace_sink=None,
        async_scheduling: bool = False,
    ):
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        tracer = Tracer(trace_sink) if config.trace_blocks else None
        self.kv = KVCacheManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching, tracer)
        self.input_processor = InputProcessor(
            tokenizer, vocab_size, config.max_model_len, config.block_size, config.num_kv_blocks
        )
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len, eos_token_ids
        )
        self.requests: dict[str, Request] = {}
        self._seq_to_req: dict[int, Request] = {}
        self._ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.async_scheduling = async_scheduling and hasattr(executor, "execute_async")
        # False: outputs carry token ids only (text ""), e.g. when another process detokenizes
        self.detokenize = tokenizer is not None
        self._inflight: tuple[SchedulerOutput, Any] | None = None  # async: launched, not yet resolved

    # ---- requests ----------------------------------------------------------------------
    def tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize(prompt)

    def validate_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        self.input_processor.validate_length(num_prompt_tokens, max_tokens)

    def add_request(
        self,
        request_id: str | None,
        prompt: Any,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        stream: bool = True,
    ) -> str:
        """Queue a request. With stream=True, step() returns an output for it whenever it gets a
        token (cumulative text plus delta); with stream=False only once, when it finishes."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        self.validate_length(len(ids), params.max_tokens)
        seqs = []
        for i in range(params.n):
            p = params
            if params.n > 1 and params.seed is not None:
                p = dataclasses.replace(params, seed=params.seed + i)  # re-validated, stop list rebuilt
            seqs.append(Sequence(request_id, ids, p, arrival_time))
        detoks = [IncrementalDetokenizer(self.tokenizer, ids) if self.detokenize else None for _ in seqs]
        req = Request(request_id, text, ids, seqs, detoks, [0] * len(seqs), stream)
        self.requests[request_id] = req
        for seq in seqs:
            self._seq_to_req[seq.seq_id] = req
            self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Finish a request at once, wherever it is; its blocks are free when this returns."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            self._seq_to_req.pop(seq.seq_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._inflight is not None

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update. Returns one RequestOutput per request that got new
        tokens or finished in this step (cumulative text plus this step's delta).

        With async_scheduling (and an executor that has execute_async), the step launched here
        runs on the device while the previous step's tokens are resolved and the next step is
        scheduled; outputs then lag one step behind the launches."""
        if self.async_scheduling:
            return self._step_async()
        sched = self.scheduler.schedule()
        if not sched:
            return []
        sampled = self.executor.execute(sched)
        return self._process(self.scheduler.update(sched, sampled), len(sampled))

    def _step_async(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        launched = None
        if sched:
            launched = (sched, self.executor.execute_async(sched))
            self.scheduler.advance(sched)
        outputs: list[RequestOutput] = []
        if self._inflight is not None:
            prev, handle = self._inflight
            sampled = handle.result()
            outputs = self._process(self.scheduler.resolve(prev, sampled), len(sampled))
        self._inflight = launched
        return outputs

    def _process(self, touched: list[Sequence], num_sampled: int) -> list[RequestOutput]:
        self.num_generation_tokens += num_sampled
        reqs: dict[str, Request] = {}
        for seq in touched:
            req = self._seq_to_req.get(seq.seq_id)
            if req is None:
                continue  # aborted while its step ran
            if seq.num_resolved_output_tokens == 1:
                self.num_prompt_tokens += seq.num_prompt_tokens
            if req.stream or seq.sampling_params.stop_list:
                self._detokenize(req, seq)
            elif seq.status.finished and req.detoks[0] is not None:
                req.detoks[req.seqs.index(seq)].decode_all(seq.output_token_ids)  # decode once, at the end
            if req.stream or seq.status.finished:
                reqs[req.request_id] = req
        outputs = [
            self._make_output(req) for req in reqs.values() if req.stream or all(s.status.finished for s in req.seqs)
        ]
        for out in outputs:
            if out.finished:
                req = self.requests.pop(out.request_id)
                for seq in req.seqs:
                    self._seq_to_req.pop(seq.seq_id, None)
        return outputs

    def _detokenize(self, req: Request, seq: Sequence) -> None:
        idx = req.seqs.index(seq)
        detok = req.detoks[idx]
        if detok is None:
            return
        before = len(detok.text)
        detok.step([seq.last_resolved_token])
        stops = seq.sampling_params.stop_list
        if stops and not seq.status.finished and seq.num_resolved_output_tokens >= seq.sampling_params.min_tokens:
            window_start = max(0, before - max(map(len, stops)) + 1)
            hit = min(((pos, s) for s in stops if (pos := detok.text.find(s, window_start)) >= 0), default=None)
            if hit is not None:
                detok.text = detok.text[: hit[0]]
                seq.stop_reason = hit[1]
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        if seq.status.finished and not isinstance(seq.stop_reason, str):
            detok.flush()  # EOS, stop token or length: nothing more will complete it

    def _make_output(self, req: Request) -> RequestOutput:
        completions = []
        for i, (seq, detok) in enumerate(zip(req.seqs, req.detoks, strict=False)):
            text = detok.text if detok is not None else ""
            end = len(text)
            stops = seq.sampling_params.stop_list
            if stops and not seq.status.finished:  # hold back what may be the start of a stop string
                end = max(req.emitted[i], end - max(map(len, stops)) + 1)
            delta = text[req.emitted[i] : end]
            req.emitted[i] = end
            n_out = seq.num_resolved_output_tokens
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=seq.output_token_ids[:n_out],
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    delta_text=delta,
                    delta_token_ids=[seq.last_resolved_token] if n_out else [],
                )
            )
        first = req.seqs[0]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=all(s.status.finished for s in req.seqs),
            num_cached_tokens=first.num_cached_tokens,
            metrics=RequestMetrics(first.arrival_time, first.first_token_time, first.finish_time),
        )

    # ---- metrics -----------------------------------------------------------------------
    def get_metrics(self) -> dict[str, float | int]:
        kv = self.kv
        q, h = kv.prefix_query_tokens, kv.prefix_hit_tokens
        return {
            "num_kv_blocks": kv.num_blocks,
            "num_free_kv_blocks": kv.num_free_blocks,
            "kv_cache_usage": kv.usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_query_tokens": q,
            "prefix_cache_hit_tokens": h,
            "prefix_cache_hit_rate": h / q if q else 0.0,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "num_requests_running": len({s.request_id for s in self.scheduler.running}),
            "num_requests_waiting": len(
                {s.request_id for s in self.scheduler.waiting} - {s.request_id for s in self.scheduler.running}
            ),
            "num_prefix_cache_evictions": kv.pool.num_evictions,
        }
