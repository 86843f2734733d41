"""AsyncLLM: the engine loop in its own thread, requests as asyncio streams.

The engine is not thread-safe, so exactly one thread (the engine thread) ever calls it after
start-up. Everything else talks to that thread through `_new` / `_aborts`, guarded by one
condition variable; the engine thread sleeps on it when there is no work (no busy spin).
Outputs go back to each caller's event loop with one `call_soon_threadsafe` per loop per
step, and from there into the request's own RequestStream (a one-slot collector).

Prompts are tokenized and validated on the caller's side before anything is queued, so a bad
request raises `ValueError` at once and never reaches the engine thread.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.engine.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")

LOG_INTERVAL_S = 10.0
STATS_INTERVAL_S = 0.02      # engine stats are republished at most this often while busy (and when idle)


class QueueFullError(RuntimeError):
    """More requests are waiting than max_queue_len allows (the server answers 429)."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down or stopped and takes no new requests (the server answers 503)."""


class EngineStepError(RuntimeError):
    """The engine raised while running this request (a bug, not the caller's mistake)."""


@dataclass
class _Pending:
    request_id: str
    prompt: Any                  # {"prompt": text, "prompt_token_ids": ids} or ids, already validated
    params: SamplingParams
    arrival_time: float
    stream: bool
    handle: "RequestStream"
    seq: int = 0                 # submission order: an abort cancels only what was submitted before it


class RequestStream:
    """The outputs of one request, as an async iterator. Iterating ends after the output with
    `finished=True` (which is `finish_reason == "abort"` for an aborted request).

    Like vLLM's output collector, it holds at most one pending output: when the consumer falls
    behind, new outputs merge into it (cumulative fields from the newest, deltas concatenated),
    so a slow consumer gets fewer, larger chunks instead of an ever-growing queue."""

    def __init__(self, owner: "AsyncLLM", request_id: str, loop: asyncio.AbstractEventLoop):
        self.owner = owner
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self.last: RequestOutput | None = None    # engine thread only: the latest output, for abort
        self._pending: RequestOutput | BaseException | None = None    # caller's loop only
        self._waiter: asyncio.Future | None = None

    def _put(self, item: RequestOutput | BaseException) -> None:
        """On the caller's loop."""
        if self._pending is None or isinstance(item, BaseException):
            self._pending = item
        elif not isinstance(self._pending, BaseException):
            self._pending = _merge(self._pending, item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._pending is None:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item, self._pending = self._pending, None
        if isinstance(item, BaseException):
            self.finished = True
            self.owner._forget(self.request_id)
            raise item
        if item.finished:
            self.finished = True
            self.owner._forget(self.request_id)
        return item

    def close(self) -> None:
        """Stop listening; abort the request if it has not finished."""
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)
            self.owner._forget(self.request_id)


def _merge(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """`new`, with the deltas of `old` (an output the consumer has not seen yet) in front."""
    prev = {o.index: o for o in old.outputs}
    outs = []
    for o in new.outputs:
        p = prev.get(o.index)
        if p is not None and (p.delta_text or p.delta_token_ids):
            o = dataclasses.replace(o, delta_text=p.delta_text + o.delta_text,
                                    delta_token_ids=list(p.delta_token_ids) + list(o.delta_token_ids))
        outs.append(o)
    return dataclasses.replace(new, outputs=outs)


@dataclass
class _Stats:
    """What the engine thread last published; read by /metrics and by the queue-length check."""
    engine: dict = field(default_factory=dict)
    time: float = 0.0


class AsyncLLM:
    """`AsyncLLM(model, **llm_kwargs)` or `AsyncLLM(llm=LLM(...))`.

    `async for out in async_llm.generate(prompt, params): ...` streams RequestOutputs
    (cumulative `text`, this step's `delta_text`). `abort(request_id)` from any thread or loop.
    """

    def __init__(self, model: str | None = None, *, llm: Any = None, max_queue_len: int | None = None,
                 log_stats: bool = True, **llm_kwargs: Any):
        if llm is None:
            from pagedllm.entrypoints.llm import LLM
            if model is None:
                from pagedllm import default_model_path
                model = default_model_path()
            llm = LLM(model, **llm_kwargs)
            self._owns_llm = True
        else:
            if model is not None or llm_kwargs:
                raise ValueError("pass either llm= or the LLM arguments, not both")
            self._owns_llm = False
        if max_queue_len is not None and (not isinstance(max_queue_len, int) or max_queue_len < 0):
            raise ValueError(f"max_queue_len must be a non-negative integer or None, got {max_queue_len!r}")
        self.llm = llm
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.max_model_len = self.engine.config.max_model_len
        self.max_queue_len = max_queue_len
        self.log_stats = log_stats
        # caller side
        self._ids = itertools.count()
        self._live: set[str] = set()                     # request ids with an unfinished stream
        self.finish_callbacks: list[Callable[[RequestOutput], None]] = []   # run on the caller's loop
        # shared with the engine thread (under _cond)
        self._cond = threading.Condition(threading.Lock())
        self._new: list[_Pending] = []
        self._aborts: list[tuple[str, int]] = []         # (request_id, submissions before the abort)
        self._submitted = 0
        self._stopping = False
        # engine thread only
        self._active: dict[str, RequestStream] = {}
        self.stats = _Stats(self.engine.get_metrics(), time.monotonic())
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    # ---- caller side ---------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def num_waiting(self) -> int:
        """Requests queued but not yet running (an estimate at most one step old)."""
        return len(self._new) + int(self.stats.engine.get("num_requests_waiting", 0))

    def add_request(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None,
                    *, stream: bool = True) -> RequestStream:
        """Validate and queue one request; returns its stream at once. Raises ValueError for a bad
        prompt or parameters, QueueFullError, EngineShutdownError. Must run inside an event loop."""
        loop = asyncio.get_running_loop()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self.engine.tokenize(prompt)
        self.engine.validate_length(len(ids), params.max_tokens)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        request_id = str(request_id)
        handle = RequestStream(self, request_id, loop)
        pending = _Pending(request_id, ids if text is None else {"prompt": text, "prompt_token_ids": ids},
                           params, time.monotonic(), stream, handle)
        with self._cond:
            if self._stopping or not self._thread.is_alive():
                raise EngineShutdownError("the engine is shutting down")
            if request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already in use")
            if self.max_queue_len is not None and self.num_waiting() >= self.max_queue_len:
                raise QueueFullError(f"the request queue is full ({self.max_queue_len} waiting); retry later")
            self._live.add(request_id)
            self._submitted += 1
            pending.seq = self._submitted
            self._new.append(pending)
            self._cond.notify()
        return handle

    async def generate(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None,
                       *, stream: bool = True) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request. Errors in the request raise on the first `__anext__`,
        before any output. Leaving the loop early (break, cancellation, disconnect) aborts it.
        stream=False yields only the final output."""
        handle = self.add_request(prompt, params, request_id, stream=stream)
        try:
            async for out in handle:
                yield out
        finally:
            handle.close()

    def abort(self, request_id: str) -> None:
        """Abort from any thread. The engine thread frees the request's blocks at the start of its
        next step, and its stream ends with an output whose finish_reason is "abort"."""
        with self._cond:
            self._aborts.append((str(request_id), self._submitted))
            self._cond.notify()

    def _forget(self, request_id: str) -> None:
        with self._cond:
            self._live.discard(request_id)

    def get_metrics(self) -> dict:
        return dict(self.stats.engine)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort everything in flight (each stream ends cleanly with finish_reason "abort"), stop
        the engine thread. New requests raise EngineShutdownError. Safe to call twice."""
        self.begin_shutdown()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._owns_llm and not self._thread.is_alive():
            close = getattr(self.llm, "close", None)
            if close is not None:
                close()
            self._owns_llm = False

    def begin_shutdown(self) -> None:
        """The non-blocking half of shutdown(): stop taking requests, abort all in flight."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    # ---- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        self._last_log = time.monotonic()
        self._logged = (self.engine.num_prompt_tokens, self.engine.num_generation_tokens)
        self._busy_since_log = False
        while True:
            with self._cond:
                while not (self._new or self._aborts or self._stopping or self.engine.has_unfinished_requests()):
                    self._publish_stats(force=True)
                    self._cond.wait()
                new, self._new = self._new, []
                aborts, self._aborts = self._aborts, []
                stopping = self._stopping
            deliveries: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
            try:
                if stopping:
                    for p in new:
                        self._send(deliveries, p.handle, _aborted(p.request_id, None))
                    for rid in list(self._active):
                        self._abort_one(rid, deliveries)
                    return
                self._iteration(new, aborts, deliveries)
            except Exception as e:                # an engine bug: fail what is in flight, keep serving
                logger.exception("engine step failed; failing %d request(s)", len(self._active))
                for rid, handle in list(self._active.items()):
                    try:
                        self.engine.abort_request(rid)
                    except Exception:
                        pass
                    self._send(deliveries, handle, EngineStepError(f"engine step failed: {e!r}"))
                self._active.clear()
            finally:
                self._deliver(deliveries)
                self._publish_stats(force=stopping or not self.engine.has_unfinished_requests())

    def _iteration(self, new: list[_Pending], aborts: list[tuple[str, int]], deliveries: dict) -> None:
        engine = self.engine
        if aborts:
            cancelled: dict[str, int] = {}
            for rid, seq in aborts:
                cancelled[rid] = max(seq, cancelled.get(rid, 0))
            for rid in cancelled:
                self._abort_one(rid, deliveries)
            kept = []
            for p in new:                         # not yet in the engine: never add it
                if p.seq <= cancelled.get(p.request_id, 0):
                    self._send(deliveries, p.handle, _aborted(p.request_id, None))
                else:
                    kept.append(p)
            new = kept
        for p in new:
            try:
                engine.add_request(p.request_id, p.prompt, p.params, arrival_time=p.arrival_time, stream=p.stream)
            except ValueError as e:               # checked on the caller's side; kept as a safety net
                self._send(deliveries, p.handle, e)
                continue
            self._active[p.request_id] = p.handle
        if engine.has_unfinished_requests():
            for out in engine.step():
                handle = self._active.get(out.request_id)
                if handle is None:
                    continue
                handle.last = out
                if out.finished:
                    del self._active[out.request_id]
                self._send(deliveries, handle, out)
            self._busy_since_log = True
        now = time.monotonic()
        if now - self._last_log >= LOG_INTERVAL_S:
            if self.log_stats and self._busy_since_log:
                self._logged = self._log_stats(now - self._last_log, self._logged)
            self._busy_since_log = False
            self._last_log = now

    def _abort_one(self, rid: str, deliveries: dict) -> None:
        handle = self._active.pop(rid, None)
        self.engine.abort_request(rid)
        if handle is not None:
            self._send(deliveries, handle, _aborted(rid, handle.last))

    @staticmethod
    def _send(deliveries: dict, handle: RequestStream, item: Any) -> None:
        deliveries[handle.loop].append((handle, item))

    def _deliver(self, deliveries: dict) -> None:
        for loop, items in deliveries.items():
            try:
                loop.call_soon_threadsafe(self._on_loop, items)
            except RuntimeError:                  # that caller's loop is closed: nobody is listening
                pass

    def _on_loop(self, items: list) -> None:
        for handle, item in items:
            handle._put(item)
            if isinstance(item, RequestOutput) and item.finished:
                for cb in self.finish_callbacks:
                    try:
                        cb(item)
                    except Exception:
                        logger.exception("finish callback failed")

    def _publish_stats(self, force: bool) -> None:
        now = time.monotonic()
        if force or now - self.stats.time >= STATS_INTERVAL_S:
            self.stats = _Stats(self.engine.get_metrics(), now)

    def _log_stats(self, elapsed: float, logged: tuple[int, int]) -> tuple[int, int]:
        engine = self.engine
        m = self.stats.engine
        prompt, gen = engine.num_prompt_tokens, engine.num_generation_tokens
        logger.info("prompt throughput: %.1f tok/s, generation throughput: %.1f tok/s, running: %d, "
                    "waiting: %d, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
                    (prompt - logged[0]) / elapsed, (gen - logged[1]) / elapsed,
                    m.get("num_requests_running", 0), m.get("num_requests_waiting", 0),
                    100 * m.get("kv_cache_usage", 0.0), 100 * m.get("prefix_cache_hit_rate", 0.0))
        return prompt, gen

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _aborted(request_id: str, last: RequestOutput | None) -> RequestOutput:
    """The final output of an aborted request: what it had produced so far, finish_reason "abort"."""
    if last is None:
        return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[],
                             outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort")],
                             finished=True)
    outs = [CompletionOutput(index=o.index, text=o.text, token_ids=list(o.token_ids),
                             finish_reason=o.finish_reason or "abort", stop_reason=o.stop_reason)
            for o in last.outputs]
    return RequestOutput(request_id=request_id, prompt=last.prompt, prompt_token_ids=last.prompt_token_ids,
                         outputs=outs, finished=True, num_cached_tokens=last.num_cached_tokens,
                         metrics=last.metrics)
