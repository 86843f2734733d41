"""AsyncLLM: requests as asyncio streams, the engine in its own process (vLLM v1's split).

    API process (this object, on one event loop)       engine core process (engine_core.py)
    InputProcessor.process -> EngineCoreRequest ------> scheduler, KV cache, model runner
    StreamRegistry (streams.py) <- output handler <---- Step per step: token ids, finish reasons,
    OutputProcessor: text, stop strings, deltas          timestamps, metrics (engine/messages.py)

The parts: core_client.py starts and talks to the core; output_handler.py reads the core's
events on the event loop and hands them to the registry of live streams (streams.py), which
runs them through the one output processor (engine/output_processor.py). A request is checked
once, by `input_processor.process`, before anything is sent; the core trusts it. One event loop
owns the output handler (the first running loop that uses this AsyncLLM; output_handler.py):
requests from another loop while it runs are refused with a RuntimeError.

Lifecycle (`EngineState`): RUNNING -> STOPPING (begin_shutdown: no new requests, open streams
end with finish_reason "abort") -> STOPPED (the core said Bye or its pipe closed); RUNNING -> DEAD
when the core goes away unasked: every open stream and every new request raises
EngineShutdownError. `AsyncLLM(llm=LLM(...))` or `engine_process=False` runs the same core loop
on a thread of this process instead (tests, debugging).

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
from typing import Any

from pagedllm.engine.grammar import grammar_tokenizer
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.messages import Abort, EngineCoreRequest, Metrics, Shutdown, StopSequences
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.sampling_params import SamplingParams, sampling_params_with_defaults
from pagedllm.engine.timeline import timeline_from_env
from pagedllm.entrypoints.core_client import CoreAttachment, EngineCoreClient
from pagedllm.entrypoints.engine_state import EngineShutdownError, EngineState, EngineStepError, QueueFullError
from pagedllm.entrypoints.output_handler import OutputHandler
from pagedllm.entrypoints.streams import RequestStream, StreamRegistry

__all__ = ["AsyncLLM", "EngineShutdownError", "EngineState", "EngineStepError", "QueueFullError", "RequestStream"]

logger = logging.getLogger("pagedllm")

LOG_INTERVAL_S = 10.0


@dataclasses.dataclass
class _Stats:
    """The core's latest metrics dict (LLMEngine.get_metrics()) and when it arrived."""

    engine: dict = dataclasses.field(default_factory=dict)
    time: float = 0.0


class AsyncLLM:
    """`AsyncLLM(model, **llm_kwargs)` starts the engine core process with `LLM(model, **llm_kwargs)`
    and loads only the tokenizer here. `AsyncLLM(llm=LLM(...))` or `engine_process=False` runs
    the core loop on a thread of this process.

    `async for out in async_llm.generate(prompt, params): ...` streams RequestOutputs
    (cumulative `text`, this output's `delta_text`). With n > 1 each output holds every sequence
    (`outputs[i].index == i`), as LLMEngine's do; a best_of > n request yields only its final
    output (the n best). `abort(request_id)` from any thread. `log_requests`: one INFO line per
    queued request (its id, prompt length and SamplingParams), as vLLM's request log.
    `stream_interval` N: a stream's outputs after its first come once a sequence has N new tokens
    (and at its end), each with all of them (streams.py).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        llm: Any = None,
        max_queue_len: int | None = None,
        stream_interval: int = 1,
        log_stats: bool = True,
        log_requests: bool = False,
        engine_process: bool | None = None,
        startup_timeout: float | None = None,
        attach: CoreAttachment | None = None,
        **llm_kwargs: Any,
    ):
        if max_queue_len is not None and (not isinstance(max_queue_len, int) or max_queue_len < 0):
            raise ValueError(f"max_queue_len must be a non-negative integer or None, got {max_queue_len!r}")
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
        self._owns_llm = False
        if attach is not None and (llm is not None or model is None):
            raise ValueError("attach= takes the model (for its tokenizer), not llm=")
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
            if engine_process is False and attach is None:
                from pagedllm.entrypoints.llm import LLM

                llm = LLM(model, **llm_kwargs)
                self._owns_llm = True
            else:  # a hub id becomes its cached snapshot here: this process loads the tokenizer from it
                from pagedllm.entrypoints.model_dir import resolve_model_path

                model = resolve_model_path(
                    model, llm_kwargs.pop("revision", None), llm_kwargs.pop("download_dir", None)
                )
                if llm_kwargs.get("tokenizer") is not None:
                    llm_kwargs["tokenizer"] = resolve_model_path(llm_kwargs["tokenizer"], param="tokenizer")
        self.llm = llm  # None when the engine runs in its own process
        self.engine = llm.engine if llm is not None else None
        if llm is not None:
            self.core = EngineCoreClient(llm=llm, name="pagedllm-engine")
            self.tokenizer = llm.tokenizer
            self.generation_defaults: dict[str, Any] = llm.generation_defaults
        else:
            assert model is not None
            if attach is None:
                self.core = EngineCoreClient(llm_kwargs={"model": model, **llm_kwargs})
            else:  # another process spawned the core and read its Ready (api_processes.py)
                self.core = EngineCoreClient.attach(attach.pipes, attach.core_pid)
            try:  # meanwhile the core loads the model
                from pagedllm.entrypoints.model_dir import generation_defaults, load_tokenizer

                self.tokenizer = load_tokenizer(llm_kwargs.get("tokenizer") or model)
                # the model's sampling defaults (its generation_config.json), read as the engine reads them
                self.generation_defaults = generation_defaults(model, llm_kwargs.get("generation_config", "auto"))
            except BaseException:
                self.core.send(Shutdown())
                self.core.close(10)
                raise
        info = attach.info if attach is not None else self.core.wait_ready(startup_timeout)
        self.core_pid = self.core.pid
        self.model_path = info.model_path or model
        self.max_model_len = info.max_model_len
        self.block_size = info.block_size
        self.num_kv_blocks = info.num_kv_blocks
        self.vocab_size = info.vocab_size
        self.max_num_seqs = info.max_num_seqs
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            self.block_size,
            self.num_kv_blocks,
            max_num_seqs=self.max_num_seqs,
            kv_cache_groups=info.kv_cache_groups,
            max_num_batched_tokens=info.max_num_batched_tokens,
            # the edge compiles each grammar over this tokenizer (the core compiles its own copy)
            grammar_tokenizer=None
            if self.tokenizer is None
            else grammar_tokenizer(self.tokenizer, self.vocab_size, info.eos_token_ids),
        )
        self.max_queue_len = max_queue_len
        self.log_stats = log_stats
        self.log_requests = log_requests
        self.stats = _Stats(info.metrics, time.monotonic())
        self.registry = StreamRegistry(
            OutputProcessor(self.tokenizer), self._abort_in_core, self._stop_in_core, stream_interval
        )
        # several API processes over one core: core ids unique across them, the queue counted over all
        self._id_prefix = "" if attach is None else f"{attach.index}."
        self._board = None if attach is None else attach.waiting
        if attach is not None and attach.waiting is not None:
            self.registry.publish_waiting = attach.publish_waiting
        self.finish_callbacks: list[Callable[[RequestOutput], None]] = self.registry.finish_callbacks
        self.state = EngineState.RUNNING
        self._dead_reason: str | None = None
        self._lock = threading.Lock()  # state changes
        self.timeline = timeline_from_env("api")  # PAGEDLLM_TIMELINE: the latency breakdown's API half
        self.output_handler = OutputHandler(
            self.core, self.registry, self._set_stats, self._core_gone, EngineStepError, self.timeline
        )
        self._ids = itertools.count()
        self._core_ids = itertools.count()
        self._last_log = time.monotonic()
        m = self.stats.engine
        self._logged = (m.get("num_prompt_tokens", 0), m.get("num_generation_tokens", 0))
        atexit.register(self._atexit)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams of a request that sets nothing: the model's generation defaults."""
        return sampling_params_with_defaults(self.generation_defaults)

    # ---- caller side ---------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self.state is EngineState.RUNNING and self.core.is_alive()

    @property
    def is_dead(self) -> bool:
        """The engine core died (or its thread stopped) without being asked to."""
        return self.state is EngineState.DEAD or (self.state is EngineState.RUNNING and not self.core.is_alive())

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is dead ("the engine core process died (exit code -9)"), once it is."""
        return self._dead_reason

    def num_waiting(self) -> int:
        """Requests sent to the engine that have no token yet (queued or prefilling), by every API
        process of the server (each publishes its own count; the others' are a moment old)."""
        if self._board is None:
            return self.registry.num_waiting
        return int(sum(self._board))

    def add_request(
        self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None, *, stream: bool = True
    ) -> RequestStream:
        """Queue one request; returns its stream at once. `prompt` is checked here by
        `input_processor.process` (InvalidRequestError), unless it is an EngineCoreRequest that
        process() made (its own id and params are used). Raises QueueFullError, EngineShutdownError.
        Must run on the event loop that owns this AsyncLLM (see the module docstring)."""
        loop = asyncio.get_running_loop()
        checked = isinstance(prompt, EngineCoreRequest)
        if checked:
            assert params is None or params is prompt.params
            params = prompt.params
        elif params is None:
            params = SamplingParams()
        if checked:
            request = prompt
        else:
            rid = f"req-{next(self._ids)}" if request_id is None else str(request_id)
            request = self.input_processor.process(rid, prompt, params)
        if self.state is not EngineState.RUNNING:
            raise EngineShutdownError(self._dead_reason or "the engine is shutting down")
        self.output_handler.own(loop)
        if self.max_queue_len is not None and self.num_waiting() >= self.max_queue_len:
            raise QueueFullError(f"the request queue is full ({self.max_queue_len} waiting); retry later")
        core_id = f"{self._id_prefix}{next(self._core_ids)}"
        handle = self.registry.register(request, core_id, stream, loop)  # before sending: outputs may come at once
        try:
            self.core.send(dataclasses.replace(request, request_id=core_id, prompt=None))
        except (OSError, ValueError):
            self.registry.unregister(handle)
            raise EngineShutdownError(self._dead_reason or "the engine core is gone") from None
        if self.timeline is not None:
            self.timeline.event("submit", rid=core_id, user=request.request_id)
        if self.log_requests:  # vLLM's per-request line, after the send: formatting it (~0.2 ms) waits for no one
            logger.info(
                "Received request %s: prompt tokens: %d, params: %s",
                request.request_id,
                len(request.prompt_token_ids),
                params,
            )
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
        self.output_handler.on_loop(self.registry.abort_request_id, str(request_id))

    def get_metrics(self) -> dict:
        """The core's latest metrics (LLMEngine.get_metrics(); at most ~20 ms old while busy)."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if not self.output_handler.owner_running():
            if loop is not None:
                self.output_handler.own(loop)
            else:
                self.output_handler.drain(0)  # nobody reads: take what is there
        return dict(self.stats.engine)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort everything in flight (each stream ends cleanly with finish_reason "abort"), stop
        the engine core and wait for it. New requests raise EngineShutdownError. Safe to call twice."""
        self.begin_shutdown()
        try:
            on_loop = asyncio.get_running_loop() is self.output_handler.loop
        except RuntimeError:
            on_loop = False
        if on_loop or not self.output_handler.owner_running():
            self.output_handler.drain(timeout)  # nobody else reads: until Bye or EOF
        self.core.close(timeout)
        if self.timeline is not None:
            self.timeline.close()
        if self._owns_llm and not self.core.is_alive():
            self.llm.close()
            self._owns_llm = False
        atexit.unregister(self._atexit)

    def begin_shutdown(self) -> None:
        """The non-blocking half of shutdown(): stop taking requests, abort all in flight."""
        with self._lock:
            if self.state is not EngineState.RUNNING:
                return
            self.state = EngineState.STOPPING
        try:
            self.core.send(Shutdown())
        except (OSError, ValueError):
            pass
        self.output_handler.on_loop(self.registry.abort_all, False)  # the core aborts everything on Shutdown

    def _atexit(self) -> None:  # an interpreter exiting without shutdown(): no orphan core
        try:
            self.shutdown(10)
        except Exception:
            pass

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _abort_in_core(self, core_ids: list[str]) -> None:
        try:
            self.core.send(Abort(core_ids))
        except (OSError, ValueError):
            pass

    def _stop_in_core(self, sequences: list[tuple[str, int]]) -> None:
        try:
            self.core.send(StopSequences(sequences))
        except (OSError, ValueError):
            pass

    def _core_gone(self) -> None:
        """Bye or EOF from the core. Expected after shutdown; otherwise it died: fail everything."""
        with self._lock:
            expected = self.state is EngineState.STOPPING
            if not expected:
                self.core.wait_exit(0.5)  # so that its exit code is known
                code = self.core.exitcode()
                self._dead_reason = (
                    "the engine core process died" + (f" (exit code {code})" if code is not None else "")
                    if self.core.spawned
                    else "the engine thread stopped"
                )
            self.state = EngineState.STOPPED if expected else EngineState.DEAD
        if not expected:
            logger.error("%s; failing %d request(s) in flight", self._dead_reason, len(self.registry))
        self.stats = _Stats(
            {**self.stats.engine, "num_requests_running": 0, "num_requests_waiting": 0}, time.monotonic()
        )
        if expected:
            self.registry.abort_all(tell_core=False)
        else:
            self.registry.fail_all(EngineShutdownError(self._dead_reason))

    def _set_stats(self, m: Metrics) -> None:
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
