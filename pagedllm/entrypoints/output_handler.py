"""The output handler: reads the engine core's events and applies them to the stream registry.

One event loop owns it: the first running loop that uses the AsyncLLM. It reads on that loop
itself (an asyncio reader on the pipe, as vLLM reads its ZMQ socket): a reader thread would have
to win the GIL back from the busy loop after every read syscall, up to sys.getswitchinterval()
each time, and fall behind the engine. While that loop runs, another loop is refused; once it
is closed (asyncio.run returned) the next loop takes over and the old loop's streams are
abandoned (aborted in the core). With no loop running, `drain` reads on the calling thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pagedllm.engine.messages import Bye, CoreEvent, Failed, Metrics, Rejected, Stats, Step
from pagedllm.engine.timeline import Timeline
from pagedllm.entrypoints.core_client import EngineCoreClient
from pagedllm.entrypoints.streams import StreamRegistry

logger = logging.getLogger("pagedllm")


class OutputHandler:
    def __init__(
        self,
        core: EngineCoreClient,
        registry: StreamRegistry,
        on_stats: Callable[[Metrics], None],
        on_gone: Callable[[], None],
        step_error: Callable[[str], BaseException],
        timeline: Timeline | None = None,
    ):
        self.core = core
        self.timeline = timeline
        self.registry = registry
        self._on_stats, self._on_gone, self._step_error = on_stats, on_gone, step_error
        self.loop: asyncio.AbstractEventLoop | None = None  # the owner
        self.closed = False  # the core said Bye or its pipe ended: nothing more to read
        self._lock = threading.Lock()  # ownership changes
        self._read_lock = threading.Lock()  # one reader at a time (a message is two reads)

    def owner_running(self) -> bool:
        loop = self.loop
        return loop is not None and not loop.is_closed() and loop.is_running()

    def own(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make `loop` the owner, unless it is already; RuntimeError if another running loop owns it."""
        if self.loop is loop:
            return
        with self._lock:
            old = self.loop
            if old is loop:
                return
            if old is not None and not old.is_closed() and old.is_running():
                raise RuntimeError(
                    "this AsyncLLM is in use on the event loop of another thread; use it from that loop "
                    "(asyncio.run_coroutine_threadsafe) or create another AsyncLLM"
                )
            self.loop = loop
            if old is not None:
                if not old.is_closed():
                    old.remove_reader(self.core.fileno())
                self.registry.abandon(old)
            if not self.closed:
                loop.add_reader(self.core.fileno(), self._on_readable)

    def on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run fn(*args) where the streams live: now if on the owner loop or none runs, else at its next turn."""
        loop = self.loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is None or here is loop or not self.owner_running():
            fn(*args)
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # closed meanwhile
            fn(*args)

    def _on_readable(self) -> None:
        if not self._read_lock.acquire(blocking=False):
            return  # shutdown() is draining
        try:
            while self.core.poll(0):  # everything that is there: one pass under load
                if not self._handle(self.core.recv()):
                    break
        except (EOFError, OSError):
            self._gone()
        except Exception:
            logger.exception("reading the engine core's outputs failed")
        finally:
            self._read_lock.release()

    def drain(self, timeout: float | None) -> None:
        """Read on this thread until Bye or the pipe's end, or for `timeout` s (0: what is there)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.closed or not self._read_lock.acquire(timeout=-1 if timeout is None else timeout):
            return
        try:
            while not self.closed:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self.core.poll(left):
                    return
                self._handle(self.core.recv())
        except (EOFError, OSError):
            self._gone()
        finally:
            self._read_lock.release()

    def _handle(self, msg: CoreEvent) -> bool:
        """One event from the core; False after the last one."""
        if isinstance(msg, Step):
            if msg.stats is not None:
                self._on_stats(msg.stats)
            if self.timeline is not None and msg.outputs:
                self.timeline.event("recv", rids=[o.request_id for o in msg.outputs])
            self.registry.apply(msg.outputs)
            if self.timeline is not None and msg.outputs:  # detokenized, the streams woken
                self.timeline.event("applied", rids=[o.request_id for o in msg.outputs])
        elif isinstance(msg, Stats):
            self._on_stats(msg.stats)
        elif isinstance(msg, Rejected):
            self.registry.fail([msg.request_id], msg.error)
        elif isinstance(msg, Failed):
            self.registry.fail(msg.request_ids, self._step_error(msg.message))
        elif isinstance(msg, Bye):
            self._gone()
            return False
        return True

    def _gone(self) -> None:
        if self.closed:
            return
        self.closed = True
        loop = self.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(loop.remove_reader, self.core.fileno())
            except RuntimeError:
                pass
        self._on_gone()
