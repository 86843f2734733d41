"""EngineCoreClient: the API process's end of the engine core (engine_core.py).

Starts the core (a spawned process, or a thread over an existing LLM), sends it typed messages
(thread-safe), receives its events (one reader at a time: AsyncLLM's output handler), and stops
it. The messages are the dataclasses of engine/messages.py, pickled over two one-way pipes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from pagedllm.engine.messages import CoreEvent, CoreInput, EngineCoreInfo, Ready, StartupError
from pagedllm.entrypoints.engine_core import core_process_main, core_thread_main, set_pipe_size

logger = logging.getLogger("pagedllm")


class EngineCoreClient:
    def __init__(self, *, llm_kwargs: dict | None = None, llm: Any = None, name: str = "pagedllm-engine-core"):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # CUDA cannot survive fork
        in_r, in_w = ctx.Pipe(duplex=False)  # API -> core
        out_r, out_w = ctx.Pipe(duplex=False)  # core -> API
        for c in (in_w, out_w):
            set_pipe_size(c)
        self._in_w, self._out_r = in_w, out_r
        self._lock = threading.Lock()
        self._reap_lock = threading.Lock()
        self.proc: Any = None
        self.thread: threading.Thread | None = None
        if llm is None:
            self.proc = ctx.Process(
                target=core_process_main,
                name=name,
                args=(in_r, out_w, llm_kwargs or {}, os.getpid(), logger.getEffectiveLevel()),
            )
            self.proc.start()  # not daemonic: the core may spawn TP workers
            in_r.close()  # our copies: EOF must reach each side when the other dies
            out_w.close()
        else:
            self.thread = threading.Thread(target=core_thread_main, args=(llm, in_r, out_w), name=name, daemon=True)
            self.thread.start()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def is_alive(self) -> bool:
        if self.proc is not None:
            return not self._exited(0)
        assert self.thread is not None
        return self.thread.is_alive()

    def _exited(self, timeout: float | None) -> bool:
        """Has the core process exited? Read from its sentinel, which never reaps it: waitpid
        from two threads at once (Process.join/is_alive) can make an exited child look alive."""
        from multiprocessing.connection import wait

        return bool(wait([self.proc.sentinel], timeout))

    def wait_exit(self, timeout: float) -> None:
        """Give an exiting core process `timeout` s, so that its exit code is known."""
        if self.proc is not None:
            self._exited(timeout)

    def exitcode(self) -> int | None:
        if self.proc is None or not self._exited(0):
            return None
        with self._reap_lock:
            self.proc.join(5)  # closed its pipes: exits (reapable) at once
            return self.proc.exitcode

    def wait_ready(self, timeout: float | None = None) -> EngineCoreInfo:
        """Block until the core has loaded the model; raise its start-up error if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._out_r.poll(0.2):
            if not self.is_alive() and not self._out_r.poll(0):
                raise RuntimeError(
                    f"the engine core exited during start-up (exit code {self.exitcode()}); see its log above"
                )
            if deadline is not None and time.monotonic() > deadline:
                self.close(0)
                raise TimeoutError(f"the engine core was not ready after {timeout:.0f} s")
        try:
            msg = self._out_r.recv()
        except EOFError:
            self.close(5)
            raise RuntimeError(f"the engine core exited during start-up (exit code {self.exitcode()})") from None
        if isinstance(msg, StartupError):
            self.close(10)
            raise msg.error
        assert isinstance(msg, Ready), type(msg).__name__
        return msg.info

    def send(self, msg: CoreInput) -> None:
        """Raises OSError (BrokenPipeError) when the core is gone."""
        with self._lock:
            self._in_w.send(msg)

    def recv(self) -> CoreEvent:
        """Raises EOFError when the core is gone."""
        msg: CoreEvent = self._out_r.recv()
        return msg

    def poll(self, timeout: float | None = 0) -> bool:
        return self._out_r.poll(timeout)

    def fileno(self) -> int:
        return self._out_r.fileno()

    def close(self, timeout: float | None = 30.0) -> None:
        """Wait for the core to exit (after Shutdown), else terminate it; close the pipes."""
        try:
            self._in_w.close()  # EOF: a core that missed Shutdown exits too
        except OSError:
            pass
        if self.proc is not None:
            if not self._exited(timeout):
                logger.warning("engine core did not exit in %.0f s; terminating it", timeout or 0)
                self.proc.terminate()
                if not self._exited(5):
                    self.proc.kill()
                    self._exited(5)
            with self._reap_lock:
                self.proc.join(5)  # reap it
        elif self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)
