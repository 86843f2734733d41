"""AsyncLLM: requests as asyncio streams, the engine in its own process (vLLM v1's split).

    API process (this object, on the event loop)      engine core process (engine_core.py)
    tokenize + validate  -> ("add", ids, params) ---> scheduler, KV cache, model runner
    RequestStream per request <- asyncio pipe reader <- one message per step: new token ids,
    (detokenize, stop strings, SSE)                     finish reasons, timestamps, metrics

The API process never touches the engine, so HTTP, JSON and detokenizing no longer take
turns with the engine loop on one GIL. The core's outputs are read on the event loop itself
(an asyncio reader on the pipe), and everything about a request (its token ids, its
detokenizer, its stream) lives on that loop. A stream keeps state, not a queue of outputs: a
consumer that falls behind gets one output with everything new since it last looked (fewer,
larger SSE chunks instead of a growing backlog), and text is decoded only when it is asked for.

Stop strings are matched here, token by token, exactly as LLMEngine does: on a hit the text is
cut, the stream finishes with finish_reason "stop" and the core is told to abort the request.
Validation happens before anything is sent, so a bad request raises ValueError at once.

If the core process dies, every open stream raises EngineShutdownError and so does every new
request; `shutdown()` (also on SIGTERM via the server) ends open streams with finish_reason
"abort" and waits for the core to exit. `AsyncLLM(llm=LLM(...))` or `engine_process=False`
runs the same core loop on a thread of this process instead (tests, debugging).

The core is started with multiprocessing's spawn method: a script that creates an AsyncLLM
at import time needs the usual `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.engine.sampling_params import SamplingParams, sampling_params_with_defaults
from pagedllm.entrypoints.engine_core import EngineCoreClient

logger = logging.getLogger("pagedllm")

LOG_INTERVAL_S = 10.0


class QueueFullError(RuntimeError):
    """More requests are waiting than max_queue_len allows (the server answers 429)."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down, stopped, or its process died: no new requests, and open
    streams end with this error (the server answers 503)."""


class EngineStepError(RuntimeError):
    """The engine raised while running this request (a bug, not the caller's mistake)."""


@dataclass
class _Stats:
    """The core's latest metrics dict (LLMEngine.get_metrics()) and when it arrived."""

    engine: dict = field(default_factory=dict)
    time: float = 0.0


class _BackendDecode:
    """`tokenizer.decode` straight from the Rust backend, skipping transformers' per-call input
    conversion (4x less time per streamed token). Used only where the two give the same text."""

    def __init__(self, backend: Any):
        self._decode = backend.decode

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._decode(ids, skip_special_tokens=skip_special_tokens)


def _fast_decoder(tokenizer: Any) -> Any:
    """What IncrementalDetokenizer should call `.decode` on: the backend when this tokenizer does
    nothing more than the backend (no clean-up of tokenization spaces; checked on a sample),
    else the tokenizer itself."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer
    fast = _BackendDecode(backend)
    try:
        n = len(tokenizer)
        sample = [list(range(i, min(n, i + 48))) for i in range(0, n, max(1, n // 16))]
        sample.append(sorted(getattr(tokenizer, "all_special_ids", []))[:8] + [0, 1, 2])
        for ids in sample:
            for skip in (True, False):
                if fast.decode(ids, skip) != tokenizer.decode(ids, skip_special_tokens=skip):
                    return tokenizer
    except Exception:
        return tokenizer
    return fast


class RequestStream:
    """One request's outputs as an async iterator; iteration ends after the output with
    `finished=True` (finish_reason "abort" for an aborted request).

    All state is touched only on the request's event loop (`loop`). Outputs are built when the
    consumer asks for one, from everything that arrived since the last: cumulative `text` and
    `token_ids`, this output's `delta_text` and `delta_token_ids`."""

    def __init__(
        self,
        owner: AsyncLLM,
        request_id: str,
        core_id: str,
        loop: asyncio.AbstractEventLoop,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stream: bool,
        arrival_time: float,
    ):
        self.owner = owner
        self.request_id = request_id
        self.core_id = core_id
        self.loop = loop
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.stream = stream
        self.stops = params.stop_list
        self.arrival_time = arrival_time
        self.token_ids: list[int] = []
        self.detok: IncrementalDetokenizer | None = None
        self.n_detok = 0  # token ids fed to the detokenizer
        self.n_seen = 0  # token ids already handed out (delta_token_ids start here)
        self.emitted = 0  # chars of text already handed out
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.done = False  # no more input: _final or error is set
        self.finished = False  # the consumer has seen the end
        self._final: RequestOutput | None = None
        self.error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        if owner._decoder is not None and (stream or self.stops):
            self.detok = IncrementalDetokenizer(owner._decoder, prompt_token_ids)

    # ---- consumer side --------------------------------------------------------------------
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
                return self._final
            if self.stream and len(self.token_ids) > self.n_seen:
                return self._output()
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def close(self) -> None:
        """Stop listening; abort the request if it has not finished."""
        if not self.done:
            self.owner._abort_handle(self)
        self.finished = True

    # ---- on the loop: inputs from the core ----------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _add(self, new: list[int], finish_reason, stop_reason, cached: int, t_first, t_finish) -> None:
        if self.done:
            return
        if new:
            if not self.token_ids:
                self.owner._started_one()
            start = len(self.token_ids)
            self.token_ids.extend(new)
            self.num_cached_tokens = cached
            if self.first_token_time is None:
                self.first_token_time = t_first
            if self.stops and self.detok is not None and self._match_stops(start, finish_reason):
                return
        if finish_reason is not None:
            self.finish_time = t_finish
            self._finish(finish_reason, stop_reason)
        elif self.stream:
            self._wake()

    def _match_stops(self, start: int, finish_reason) -> bool:
        """Detokenize the new tokens one by one and look for a stop string in the text they add,
        as LLMEngine does (not on the token that finished the request anyway, not before
        min_tokens). On a hit: cut the text there, drop later tokens, finish "stop", abort."""
        detok, stops = self.detok, self.stops
        longest = max(map(len, stops))
        last = len(self.token_ids) - 1
        for i in range(start, len(self.token_ids)):
            before = len(detok.text)
            detok.step([self.token_ids[i]])
            self.n_detok = i + 1
            if (finish_reason is not None and i == last) or i + 1 < self.params.min_tokens:
                continue
            window = max(0, before - longest + 1)
            hit = min(((pos, s) for s in stops if (pos := detok.text.find(s, window)) >= 0), default=None)
            if hit is not None:
                detok.text = detok.text[: hit[0]]
                del self.token_ids[i + 1 :]
                self.finish_time = time.monotonic()
                self.owner._abort_in_core(self.core_id)
                self._finish("stop", hit[1])
                return True
        return False

    def _finish(self, finish_reason: str, stop_reason=None, error: BaseException | None = None) -> None:
        """The request is over: build the final output now (the metrics need it), wake the consumer."""
        if self.done:
            return
        self.done = True
        self.owner._forget(self)
        if error is not None:
            self.error = error
            self._wake()
            return
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        tok = self.owner._decoder
        if tok is not None:
            if self.detok is None:  # not streamed: decode once
                self.detok = IncrementalDetokenizer(tok, self.prompt_token_ids)
                self.detok.decode_all(self.token_ids)
                self.n_detok = len(self.token_ids)
            else:
                if self.n_detok < len(self.token_ids):
                    self.detok.step(self.token_ids[self.n_detok :])
                    self.n_detok = len(self.token_ids)
                if finish_reason != "abort" and not isinstance(stop_reason, str):
                    self.detok.flush()  # EOS, stop token, length
        self._final = self._output()
        self._wake()
        for cb in self.owner.finish_callbacks:
            try:
                cb(self._final)
            except Exception:
                logger.exception("finish callback failed")

    def _output(self) -> RequestOutput:
        ids = self.token_ids
        delta_ids = ids[self.n_seen :]
        self.n_seen = len(ids)
        text = ""
        delta = ""
        if self.detok is not None:
            if self.n_detok < len(ids):
                self.detok.step(ids[self.n_detok :])
                self.n_detok = len(ids)
            text = self.detok.text
            end = len(text)
            if self.stops and not self.done:  # hold back what may be the start of a stop string
                end = max(self.emitted, end - max(map(len, self.stops)) + 1)
            delta = text[self.emitted : end]
            self.emitted = end
        done = self.done
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=text,
                    token_ids=list(ids),
                    finish_reason=self.finish_reason if done else None,
                    stop_reason=self.stop_reason if done else None,
                    delta_text=delta,
                    delta_token_ids=delta_ids,
                )
            ],
            finished=done,
            num_cached_tokens=self.num_cached_tokens,
            metrics=RequestMetrics(self.arrival_time, self.first_token_time, self.finish_time),
        )


class AsyncLLM:
    """`AsyncLLM(model, **llm_kwargs)` starts the engine core process with `LLM(model, **llm_kwargs)`
    and loads only the tokenizer here. `AsyncLLM(llm=LLM(...))` or `engine_process=False` runs
    the core loop on a thread of this process.

    `async for out in async_llm.generate(prompt, params): ...` streams RequestOutputs
    (cumulative `text`, this output's `delta_text`). `abort(request_id)` from any thread or loop.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        llm: Any = None,
        max_queue_len: int | None = None,
        log_stats: bool = True,
        engine_process: bool | None = None,
        startup_timeout: float | None = None,
        **llm_kwargs: Any,
    ):
        if max_queue_len is not None and (not isinstance(max_queue_len, int) or max_queue_len < 0):
            raise ValueError(f"max_queue_len must be a non-negative integer or None, got {max_queue_len!r}")
        self._owns_llm = False
        if llm is not None:
            if model is not None or llm_kwargs:
                raise ValueError("pass either llm= or the LLM arguments, not both")
            if engine_process:
                raise ValueError(
                    "llm= runs the engine on a thread of this process; engine_process=True needs "
                    "the model and LLM arguments instead"
                )
        else:
            if model is None:
                from pagedllm import default_model_path

                model = default_model_path()
            if engine_process is False:
                from pagedllm.entrypoints.llm import LLM

                llm = LLM(model, **llm_kwargs)
                self._owns_llm = True
        self.llm = llm  # None when the engine runs in its own process
        self.engine = llm.engine if llm is not None else None
        if llm is not None:
            self.core = EngineCoreClient(llm=llm, name="pagedllm-engine")
            self.tokenizer = llm.tokenizer
        else:
            self.core = EngineCoreClient(llm_kwargs={"model": model, **llm_kwargs})
            try:  # meanwhile the core loads the model
                from pagedllm.entrypoints.llm import _load_tokenizer

                self.tokenizer = _load_tokenizer(llm_kwargs.get("tokenizer") or model)
            except BaseException:
                self.core.send(("shutdown",))
                self.core.close(10)
                raise
        self._decoder = _fast_decoder(self.tokenizer) if self.tokenizer is not None else None
        from pagedllm.entrypoints.model_dir import generation_defaults

        # the model's sampling defaults (its generation_config.json), read here as the engine reads them
        self.generation_defaults = (
            llm.generation_defaults
            if llm is not None
            else generation_defaults(model, llm_kwargs.get("generation_config", "auto"))
        )
        info = self.core.wait_ready(startup_timeout)
        self.core_pid = self.core.pid
        self.model_path = info["model_path"] or model
        self.max_model_len = info["max_model_len"]
        self.block_size = info["block_size"]
        self.num_kv_blocks = info["num_kv_blocks"]
        self.vocab_size = info["vocab_size"]
        self.input_processor = InputProcessor(
            self.tokenizer, self.vocab_size, self.max_model_len, self.block_size, self.num_kv_blocks
        )
        self.max_queue_len = max_queue_len
        self.log_stats = log_stats
        self.stats = _Stats(info["metrics"], time.monotonic())
        self.finish_callbacks: list[Callable[[RequestOutput], None]] = []  # run on the request's loop
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._core_ids = itertools.count()
        self._live: dict[str, RequestStream] = {}  # request_id -> unfinished stream
        self._by_core_id: dict[str, RequestStream] = {}
        self._num_waiting = 0  # sent to the core, no token back yet
        self._stopping = False
        self._dead: str | None = None  # why the core is gone, once it is
        self._last_log = time.monotonic()
        m = self.stats.engine
        self._logged = (m.get("num_prompt_tokens", 0), m.get("num_generation_tokens", 0))
        self._reader_loop: asyncio.AbstractEventLoop | None = None  # the loop that reads the core's outputs
        self._read_lock = threading.Lock()  # one reader at a time (a message is two reads)
        self._gone = False
        atexit.register(self._atexit)

    # ---- inputs: tokenize and validate (the engine's own rules and messages) ----------------
    def tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize(prompt)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams of a request that sets nothing: the model's generation defaults."""
        return sampling_params_with_defaults(self.generation_defaults)

    def validate_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        self.input_processor.validate_length(num_prompt_tokens, max_tokens)

    # ---- caller side ---------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return not self._stopping and self._dead is None and self.core.is_alive()

    @property
    def is_dead(self) -> bool:
        """The engine core died (or its thread stopped) without being asked to."""
        return self._dead is not None or (not self._stopping and not self.core.is_alive())

    def num_waiting(self) -> int:
        """Requests sent to the engine that have no token yet (queued or prefilling)."""
        return self._num_waiting

    def add_request(
        self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None, *, stream: bool = True
    ) -> RequestStream:
        """Validate and queue one request; returns its stream at once. Raises ValueError for a bad
        prompt or parameters, QueueFullError, EngineShutdownError. Must run inside an event loop."""
        loop = asyncio.get_running_loop()
        if self._reader_loop is not loop:
            self._ensure_reader()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(f"SamplingParams.n must be 1 in AsyncLLM (send several requests), got {params.n}")
        text, ids = self.tokenize(prompt)
        self.validate_length(len(ids), params.max_tokens)
        core_params = dataclasses.replace(params, stop=None) if params.stop_list else params
        with self._lock:
            if self._stopping or self._dead is not None:
                raise EngineShutdownError(self._dead or "the engine is shutting down")
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
            request_id = str(request_id)
            if request_id in self._live:
                raise ValueError(f"request_id {request_id!r} is already in use")
            if self.max_queue_len is not None and self._num_waiting >= self.max_queue_len:
                raise QueueFullError(f"the request queue is full ({self.max_queue_len} waiting); retry later")
            core_id = str(next(self._core_ids))
            arrival = time.monotonic()
            handle = RequestStream(self, request_id, core_id, loop, text, ids, params, stream, arrival)
            self._live[request_id] = handle  # before sending: the reader may see its first token at once
            self._by_core_id[core_id] = handle
            self._num_waiting += 1
            try:
                self.core.send(("add", core_id, ids, core_params, arrival))
            except (OSError, ValueError):
                del self._live[request_id], self._by_core_id[core_id]
                self._num_waiting -= 1
                raise EngineShutdownError(self._dead or "the engine core is gone") from None
        return handle

    async def generate(
        self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None, *, stream: bool = True
    ) -> AsyncIterator[RequestOutput]:
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
        """Abort from any thread: the stream ends with finish_reason "abort" and the core frees the
        request's blocks at its next iteration."""
        handle = self._live.get(str(request_id))
        if handle is not None:
            self._abort_handle(handle)

    def _abort_handle(self, handle: RequestStream) -> None:
        self._abort_in_core(handle.core_id)
        self._on_loop_of(handle, handle._finish, "abort")

    def get_metrics(self) -> dict:
        """The core's latest metrics (LLMEngine.get_metrics(); at most ~20 ms old while busy)."""
        if self._reader_loop is None or self._reader_loop.is_closed():
            self._ensure_reader()
        return dict(self.stats.engine)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort everything in flight (each stream ends cleanly with finish_reason "abort"), stop
        the engine core and wait for it. New requests raise EngineShutdownError. Safe to call twice."""
        self.begin_shutdown()
        loop = self._reader_loop
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if loop is None or loop.is_closed() or not loop.is_running() or on_loop:
            self._drain(timeout)  # nobody else reads: until "bye" or EOF
        self.core.close(timeout)
        if self._owns_llm and not self.core.is_alive():
            close = getattr(self.llm, "close", None)
            if close is not None:
                close()
            self._owns_llm = False
        atexit.unregister(self._atexit)

    def begin_shutdown(self) -> None:
        """The non-blocking half of shutdown(): stop taking requests, abort all in flight."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            live = list(self._live.values())
        try:
            self.core.send(("shutdown",))
        except (OSError, ValueError):
            pass
        for handle in live:
            self._on_loop_of(handle, handle._finish, "abort")

    def _atexit(self) -> None:  # an interpreter exiting without shutdown(): no orphan core
        try:
            self.shutdown(10)
        except Exception:
            pass

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- bookkeeping shared by the loops and other threads -------------------------------------
    def _abort_in_core(self, core_id: str) -> None:
        try:
            self.core.send(("abort", [core_id]))
        except (OSError, ValueError):
            pass

    def _forget(self, handle: RequestStream) -> None:
        with self._lock:
            if self._by_core_id.pop(handle.core_id, None) is None:
                return
            if self._live.get(handle.request_id) is handle:
                del self._live[handle.request_id]
            if not handle.token_ids:
                self._num_waiting -= 1

    def _started_one(self) -> None:
        with self._lock:
            self._num_waiting -= 1

    @staticmethod
    def _on_loop_of(handle: RequestStream, fn: Callable, *args: Any) -> None:
        """Run fn(*args) on the handle's loop: now if we are on it, else at its next turn."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is handle.loop:
            fn(*args)
            return
        try:
            handle.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # that loop is closed: nobody is listening
            handle.owner._forget(handle)

    # ---- reading the core's outputs, on the event loop ---------------------------------------
    # Reading happens on the loop itself (an asyncio reader on the pipe, as vLLM reads its ZMQ
    # socket): a reader thread would have to win the GIL back from the busy loop after every
    # read syscall, up to sys.getswitchinterval() each time, and fall behind the engine.
    def _ensure_reader(self) -> None:
        """Someone must read: the first event loop that uses this AsyncLLM reads until it is
        closed, then the next one takes over (outputs for requests of other loops are handed
        over with call_soon_threadsafe). Outside any loop, with no reader: read what is there."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:
            old = self._reader_loop
            if old is None or old.is_closed():
                self._drain(0)
            return
        if not self._read_lock.acquire(blocking=False):
            return  # shutdown() is draining
        try:
            old = self._reader_loop
            if old is loop or (old is not None and not old.is_closed()) or self._gone:
                return
            self._reader_loop = loop
            loop.add_reader(self.core.fileno(), self._on_readable)
        finally:
            self._read_lock.release()

    def _on_readable(self) -> None:
        if not self._read_lock.acquire(blocking=False):
            return  # shutdown() is draining
        try:
            while self.core.poll(0):  # everything that is there: one pass under load
                if not self._handle(self.core.recv()):
                    break
        except (EOFError, OSError):
            self._core_gone()
        except Exception:
            logger.exception("reading the engine core's outputs failed")
        finally:
            if self._gone and self._reader_loop is not None and not self._reader_loop.is_closed():
                self._reader_loop.remove_reader(self.core.fileno())
            self._read_lock.release()

    def _drain(self, timeout: float | None) -> None:
        """Read in this thread until the core says "bye" or its pipe ends (used by shutdown)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._gone or not self._read_lock.acquire(timeout=-1 if timeout is None else timeout):
            return
        try:
            while not self._gone:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self.core.poll(left):
                    return
                self._handle(self.core.recv())
        except (EOFError, OSError):
            self._core_gone()
        finally:
            if self._gone and self._reader_loop is not None and not self._reader_loop.is_closed():
                try:
                    self._reader_loop.call_soon_threadsafe(self._reader_loop.remove_reader, self.core.fileno())
                except RuntimeError:
                    pass
            self._read_lock.release()

    def _handle(self, msg: tuple) -> bool:
        """One message from the core; False after the last one."""
        kind = msg[0]
        if kind == "step":
            if msg[2] is not None:
                self._set_stats(msg[2])
            self._dispatch(msg[1])
        elif kind == "stats":
            self._set_stats(msg[1])
        elif kind == "rejected":
            self._fail([msg[1]], ValueError(msg[2]))
        elif kind == "failed":
            self._fail(msg[1], EngineStepError(msg[2]))
        elif kind == "bye":
            self._core_gone()
            return False
        return True

    def _dispatch(self, entries: list) -> None:
        """Apply one step's outputs: at once for requests of the running loop, with one
        call_soon_threadsafe per other loop."""
        get = self._by_core_id.get
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        mine, others = [], None
        for e in entries:
            handle = get(e[0])
            if handle is None:  # finished, aborted or stopped meanwhile
                continue
            if handle.loop is here:
                mine.append((handle, e))
            else:
                if others is None:
                    others = {}
                others.setdefault(handle.loop, []).append((handle, e))
        if mine:
            _apply_step(mine)
        for loop, items in (others or {}).items():
            try:
                loop.call_soon_threadsafe(_apply_step, items)
            except RuntimeError:  # that loop is closed: nobody listens; stop the work
                for handle, _ in items:
                    self._abort_in_core(handle.core_id)
                    self._forget(handle)

    def _fail(self, core_ids: list[str], error: BaseException) -> None:
        for cid in core_ids:
            handle = self._by_core_id.get(cid)
            if handle is not None:
                self._on_loop_of(handle, handle._finish, "abort", None, error)

    def _core_gone(self) -> None:
        """ "bye" or EOF from the core. Expected after shutdown; otherwise it died: fail everything."""
        if self._gone:
            return
        self._gone = True
        if self.core.proc is not None:
            self.core._exited(0.5)  # so that its exit code is known
        with self._lock:
            expected = self._stopping
            if not expected:
                code = self.core.exitcode()
                self._dead = (
                    "the engine core process died" + (f" (exit code {code})" if code is not None else "")
                    if self.core.proc is not None
                    else "the engine thread stopped"
                )
            live = list(self._live.values())
        if not expected:
            logger.error("%s; failing %d request(s) in flight", self._dead, len(live))
        self.stats = _Stats(
            {**self.stats.engine, "num_requests_running": 0, "num_requests_waiting": 0}, time.monotonic()
        )
        for handle in live:
            if expected:
                self._on_loop_of(handle, handle._finish, "abort")
            else:
                self._on_loop_of(handle, handle._finish, "abort", None, EngineShutdownError(self._dead))

    def _set_stats(self, m: dict) -> None:
        now = time.monotonic()
        self.stats = _Stats(m, now)
        if now - self._last_log >= LOG_INTERVAL_S:
            prompt, gen = m.get("num_prompt_tokens", 0), m.get("num_generation_tokens", 0)
            elapsed = now - self._last_log
            if self.log_stats and (prompt, gen) != self._logged:
                logger.info(
                    "prompt throughput: %.1f tok/s, generation throughput: %.1f tok/s, running: %d, "
                    "waiting: %d, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
                    (prompt - self._logged[0]) / elapsed,
                    (gen - self._logged[1]) / elapsed,
                    m.get("num_requests_running", 0),
                    m.get("num_requests_waiting", 0),
                    100 * m.get("kv_cache_usage", 0.0),
                    100 * m.get("prefix_cache_hit_rate", 0.0),
                )
            self._logged = (prompt, gen)
            self._last_log = now


def _apply_step(items: list) -> None:
    """On one event loop: one step's outputs for the requests of that loop."""
    for handle, (_, new, finish_reason, stop_reason, cached, t_first, t_finish) in items:
        handle._add(new, finish_reason, stop_reason, cached, t_first, t_finish)
