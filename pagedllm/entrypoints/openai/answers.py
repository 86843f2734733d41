"""Waiting for the engine, for /v1/completions and /v1/chat/completions (serving.py prepares and
queues the requests): one HTTP request's engine requests (`Submitted`, one per prompt), answered
either with every final output (`finals`: a client that disconnects first aborts them) or as SSE
events (`events`, ending with [DONE] whatever happens to the engine). A request the core ended
with finish_reason "error" is a 500 naming the cause, or an error event on a stream; a step that
raised is a 500 that names only the request id; an engine that died is a 503."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.timeline import Timeline
from pagedllm.entrypoints.async_llm import EngineShutdownError, EngineStepError
from pagedllm.entrypoints.openai.errors import APIError, error_body, internal_error
from pagedllm.entrypoints.openai.responses import SSE_DONE, ResponseBuilder, sse

logger = logging.getLogger("pagedllm")

Disconnected = Callable[[], Awaitable[None]]  # returns once the client has gone away


class OutputStream(Protocol):
    """One engine request's outputs (AsyncLLM's OutputStream): iteration ends after the final
    output; `close()` aborts the request if it has not finished."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def close(self) -> None: ...


@dataclass
class SSEStream:
    """A streamed answer. `close()` aborts the engine requests that are still running; the HTTP
    layer calls it however the response ends (a cancelled body is left suspended, not closed)."""

    events: AsyncIterator[str]
    close: Callable[[], None]


class Submitted:
    """One HTTP request's engine requests (one per prompt), with their prompt lengths."""

    def __init__(self, streams: list[OutputStream], prompt_lens: list[int]):
        self.streams = streams
        self.prompt_lens = prompt_lens

    def close(self) -> None:
        for s in self.streams:
            s.close()


async def finals(sub: Submitted, rid: str, disconnected: Disconnected | None) -> list[RequestOutput]:
    """Wait for every final output; a client that disconnects first aborts them."""

    async def last(s: OutputStream) -> RequestOutput:
        out = None
        async for out in s:  # noqa: B007  (the last one is the final output)
            pass
        assert out is not None, "a request stream ends with its final output"
        return out

    work = asyncio.ensure_future(asyncio.gather(*(last(s) for s in sub.streams)))
    watch = asyncio.ensure_future(disconnected()) if disconnected is not None else None
    waits: set[asyncio.Future[Any]] = {work} if watch is None else {work, watch}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if watch is not None:
            watch.cancel()
        if not work.done():
            work.cancel()
            sub.close()
    if not work.done() or work.cancelled():
        raise APIError(499, "the client closed the connection", "invalid_request_error", None, "client_closed")
    try:
        outs = work.result()
    except EngineStepError as e:
        raise _step_failed(rid, e) from None
    except EngineShutdownError as e:
        raise APIError(503, str(e), "service_unavailable", None, "engine_dead") from None
    failed = _error_of(outs)
    if failed is not None:
        raise failed
    if any(c.finish_reason == "abort" for o in outs for c in o.outputs):
        raise APIError(
            503, "the request was aborted (the server is shutting down)", "service_unavailable", None, "aborted"
        )
    return outs


async def events(
    sub: Submitted, builder: ResponseBuilder, rid: str, include_usage: bool, timeline: Timeline | None
) -> AsyncIterator[str]:
    """The SSE events of a stream, ending with [DONE] whatever happens to the engine."""
    completion_tokens = [0] * len(sub.streams)
    try:
        for event in builder.opening():
            yield event
        async for i, out in _merged(sub.streams):
            failed = _error_of([out])
            if failed is not None:  # the core could not run it: an error event, not an empty answer
                yield sse(error_body(failed.message, failed.type, failed.param, failed.code))
                yield SSE_DONE
                return
            if timeline is not None:  # this stream's task runs again: the output is here
                timeline.event("resumed", user=out.request_id)
            completion_tokens[i] = sum(len(o.token_ids) for o in out.outputs)
            built = builder.events(i, out)
            if timeline is not None:  # its events' JSON is made
                timeline.event("built", user=out.request_id)
            for event in built:
                yield event
            if timeline is not None:  # written: the transport has the events of these tokens
                timeline.event("sse", user=out.request_id, n=completion_tokens[i])
        if include_usage:
            yield builder.usage_event(sum(sub.prompt_lens), sum(completion_tokens))
        yield SSE_DONE
    except EngineStepError as e:
        err = _step_failed(rid, e)
        yield sse(error_body(err.message, err.type))
        yield SSE_DONE
    except EngineShutdownError as e:  # the engine core died mid-stream
        yield sse(error_body(str(e), "service_unavailable", None, "engine_dead"))
        yield SSE_DONE
    finally:
        sub.close()


def _error_of(outs: list[RequestOutput]) -> APIError | None:
    """A 500 naming the cause when the core ended an output with finish_reason "error" (a grammar
    that failed to compile there); None when none did."""
    for o in outs:
        for c in o.outputs:
            if c.finish_reason == "error":
                logger.error("request %s failed in the engine: %s", o.request_id, c.error)
                return APIError(
                    500, str(c.error), "internal_server_error", "structured_outputs", "grammar_compile_failed"
                )
    return None


def _step_failed(rid: str, e: EngineStepError) -> APIError:
    """The engine raised on this request: the reason goes to the log (the core logged the
    traceback), the client gets the request id and nothing internal."""
    logger.error("request %s failed in the engine: %s", rid, e)
    return internal_error(rid)


async def _merged(streams: list[OutputStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams in arrival order, until all have finished."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(i: int, s: OutputStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
        except BaseException as e:  # handed to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
