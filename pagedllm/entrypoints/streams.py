"""The live request streams of one AsyncLLM: RequestStream (what a caller iterates) and the
StreamRegistry that owns them.

The registry is the only thing a stream talks to, and the only place its state changes: it
feeds the core's outputs through the output processor (engine/output_processor.py), wakes the
streams that have something new, finishes them, and tells the core what a stream no longer
wants: a closed stream's request is aborted, a sequence that hit a stop string is stopped alone
(an n > 1 request's other sequences go on). Everything here runs on AsyncLLM's one event
loop (or, when no loop runs, on the one thread that reads the core: async_llm.py).

A stream keeps state, not a queue of outputs: a consumer that falls behind gets one output with
everything new since it last looked (fewer, larger SSE chunks instead of a growing backlog), and
text is decoded only when an output is asked for. `stream_interval` N > 1 holds a stream's
outputs until one of its sequences has N tokens not yet sent (its first token and its end go at
once): fewer, larger chunks, so the API process spends less time per token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.engine.output_processor import OutputProcessor, RequestState
from pagedllm.engine.outputs import RequestOutput

logger = logging.getLogger("pagedllm")


class RequestStream:
    """One request's outputs as an async iterator; iteration ends after the output with
    `finished=True` (finish_reason "abort" for an aborted request), or raises the request's error
    (EngineShutdownError, EngineStepError, a rejected request's InvalidRequestError)."""

    def __init__(self, registry: StreamRegistry, state: RequestState, core_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = state.request_id
        self.core_id = core_id  # the id the core knows it by (never reused)
        self.state = state
        self.loop = loop
        self._registry = registry
        self.started = False  # a token has arrived (it no longer counts as waiting)
        self.done = False  # no more input: final or error is set
        self.finished = False  # the consumer has seen the end
        self.final: RequestOutput | None = None
        self.error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while True:
            if self.done:
                self.finished = True
                if self.error is not None:
                    raise self.error
                assert self.final is not None
                return self.final
            if self.state.stream and self._registry.ready(self):
                return self._registry.output(self)
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def close(self) -> None:
        """Stop listening; abort the request if it has not finished."""
        if not self.done:
            self._registry.abort(self)
        self.finished = True

    def wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            try:
                w.set_result(None)
            except RuntimeError:  # its loop is closed: nobody is listening
                pass


class StreamRegistry:
    """Live streams by request id and by core id. `num_waiting`: registered, no token yet."""

    def __init__(
        self,
        processor: OutputProcessor,
        abort_in_core: Callable[[list[str]], None],
        stop_in_core: Callable[[list[tuple[str, int]]], None],
        stream_interval: int = 1,
    ):
        """`abort_in_core(core ids)` ends whole requests in the core; `stop_in_core([(core id,
        index)])` ends the sequences that hit a stop string (the others of an n > 1 request go on).
        `stream_interval`: the unsent tokens a sequence gathers before its stream wakes (1: each)."""
        self.processor = processor
        self.stream_interval = stream_interval
        self._abort_in_core = abort_in_core
        self._stop_in_core = stop_in_core
        self.by_request_id: dict[str, RequestStream] = {}
        self.by_core_id: dict[str, RequestStream] = {}
        self._num_waiting = 0
        # several API processes (api_processes.py): each process's count, published where the others read it
        self.publish_waiting: Callable[[int], None] | None = None
        self.finish_callbacks: list[Callable[[RequestOutput], None]] = []  # each finished request's final output

    def __len__(self) -> int:
        return len(self.by_core_id)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @num_waiting.setter
    def num_waiting(self, value: int) -> None:
        self._num_waiting = value
        if self.publish_waiting is not None:
            self.publish_waiting(value)

    def register(
        self, request: EngineCoreRequest, core_id: str, stream: bool, loop: asyncio.AbstractEventLoop
    ) -> RequestStream:
        if request.request_id in self.by_request_id:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in use", "request_id")
        state = self.processor.add_request(request, stream, core_id)
        handle = RequestStream(self, state, core_id, loop)
        self.by_request_id[request.request_id] = handle
        self.by_core_id[core_id] = handle
        self.num_waiting += 1
        return handle

    def unregister(self, handle: RequestStream) -> None:
        """Undo register() (the core never heard of it)."""
        self.processor.abort_request(handle.core_id)
        self._forget(handle)

    # ---- from the core ---------------------------------------------------------------------
    def apply(self, outputs: list[EngineCoreOutput]) -> None:
        """One step's outputs: stop strings abort in the core at once; finished streams end."""
        processed = self.processor.process(outputs)
        if processed.stopped:
            self._stop_in_core(processed.stopped)
        get = self.by_core_id.get
        done = set(processed.finished)
        for state in processed.touched:
            handle = get(state.core_request_id)
            if handle is None:
                continue
            if not handle.started and state.num_output_tokens:
                handle.started = True
                self.num_waiting -= 1
            if state in done:
                self._end(handle, self.processor.make_output(state))
            elif state.stream and self.ready(handle):
                handle.wake()

    def fail(self, core_ids: list[str], error: BaseException) -> None:
        for core_id in core_ids:
            handle = self.by_core_id.get(core_id)
            if handle is not None:
                self.processor.abort_request(core_id)
                self._end(handle, None, error)

    def fail_all(self, error: BaseException) -> None:
        self.fail(list(self.by_core_id), error)

    # ---- from the API side -------------------------------------------------------------------
    def ready(self, handle: RequestStream) -> bool:
        """A streamed output is due: new tokens, and either none sent yet (the first token goes at
        once), or a sequence with stream_interval of them unsent, or one that has finished."""
        state = handle.state
        if self.stream_interval == 1 or not any(s.num_sent_tokens for s in state.seqs):
            return state.has_new_tokens
        every = self.stream_interval
        return any(
            (unsent := len(s.token_ids) - s.num_sent_tokens) >= every or (unsent and s.finished) for s in state.seqs
        )

    def output(self, handle: RequestStream) -> RequestOutput:
        """The stream's next output: everything since the last one."""
        return self.processor.make_output(handle.state)

    def abort(self, handle: RequestStream, tell_core: bool = True) -> None:
        """End the stream with finish_reason "abort" and free the request in the core."""
        if handle.done or self.by_core_id.get(handle.core_id) is not handle:
            return
        if tell_core:
            self._abort_in_core([handle.core_id])
        self.processor.abort_request(handle.core_id)
        self._end(handle, self.processor.make_output(handle.state))

    def abort_all(self, tell_core: bool = True) -> None:
        for handle in list(self.by_core_id.values()):
            self.abort(handle, tell_core)

    def abort_request_id(self, request_id: str) -> None:
        handle = self.by_request_id.get(request_id)
        if handle is not None:
            self.abort(handle)

    def abandon(self, loop: asyncio.AbstractEventLoop) -> None:
        """The streams of a loop that is gone: nobody can listen; stop their work."""
        gone = [h for h in self.by_core_id.values() if h.loop is loop]
        if gone:
            self._abort_in_core([h.core_id for h in gone])
        for handle in gone:
            self.processor.abort_request(handle.core_id)
            self._forget(handle)

    # ---- bookkeeping -----------------------------------------------------------------------
    def _end(self, handle: RequestStream, final: RequestOutput | None, error: BaseException | None = None) -> None:
        if handle.done:
            return
        handle.done = True
        self._forget(handle)
        handle.final, handle.error = final, error
        handle.wake()
        if final is None:
            return
        for cb in self.finish_callbacks:
            try:
                cb(final)
            except Exception:
                logger.exception("finish callback failed")

    def _forget(self, handle: RequestStream) -> None:
        if self.by_core_id.pop(handle.core_id, None) is None:
            return
        if self.by_request_id.get(handle.request_id) is handle:
            del self.by_request_id[handle.request_id]
        if not handle.started:
            self.num_waiting -= 1
