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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.messages import CoreEvent, CoreInput, EngineCoreInfo, Ready, StartupError
from pagedllm.entrypoints.engine_core import core_process_main, core_thread_main, set_pipe_size

logger = logging.getLogger("pagedllm")


@dataclass
class CoreAttachment:
    """What an API process of `pagedllm serve --api-server-count N` gets from the front process:
    its pipes to the shared core, the core's pid and Ready info, its index (its core ids start with
    `f"{index}."`, so that ids are unique across the N processes) and the board of waiting counts
    (a shared array of N integers: slot i is process i's requests with no token yet)."""

    pipes: tuple[Any, Any]
    core_pid: int
    info: EngineCoreInfo
    index: int
    waiting: Any = None  # multiprocessing.Array("q", N, lock=False), or None

    def publish_waiting(self, count: int) -> None:
        if self.waiting is not None:
            self.waiting[self.index] = count


def start_core_process(
    llm_kwargs: dict, num_clients: int = 1, name: str = "pagedllm-engine-core"
) -> tuple[Any, list[tuple[Any, Any]]]:
    """Spawn the engine core process for `num_clients` API processes. Returns the process and, per
    client, the API side's (input writer, output reader) pipe ends; the core's ends are closed
    here, so that each side reads EOF when the other dies."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # CUDA cannot survive fork
    api_ends, core_ends = [], []
    for _ in range(num_clients):
        in_r, in_w = ctx.Pipe(duplex=False)  # API -> core
        out_r, out_w = ctx.Pipe(duplex=False)  # core -> API
        for c in (in_w, out_w):
            set_pipe_size(c)
        api_ends.append((in_w, out_r))
        core_ends.append((in_r, out_w))
    proc = ctx.Process(
        target=core_process_main,
        name=name,
        args=(core_ends, llm_kwargs, os.getpid(), logger.getEffectiveLevel()),
    )
    proc.start()  # not daemonic: the core may spawn TP workers
    for in_r, out_w in core_ends:  # our copies
        in_r.close()
        out_w.close()
    return proc, api_ends


class EngineCoreClient:
    """One API process's end of the core. Three ways to have one: `EngineCoreClient(llm_kwargs=...)`
    spawns a core of its own; `EngineCoreClient(llm=LLM(...))` runs the loop on a thread over that
    LLM; `EngineCoreClient.attach(pipes, pid)` takes the pipes of a core that another process (the
    front process of `pagedllm serve --api-server-count N`) spawned and supervises."""

    def __init__(self, *, llm_kwargs: dict | None = None, llm: Any = None, name: str = "pagedllm-engine-core"):
        self._lock = threading.Lock()
        self._reap_lock = threading.Lock()
        self.proc: Any = None
        self.thread: threading.Thread | None = None
        self._core_pid: int | None = None  # attached: the core is not our child
        if llm is None:
            self.proc, [(self._in_w, self._out_r)] = start_core_process(llm_kwargs or {}, 1, name)
        else:
            import multiprocessing

            ctx = multiprocessing.get_context("spawn")
            in_r, self._in_w = ctx.Pipe(duplex=False)
            self._out_r, out_w = ctx.Pipe(duplex=False)
            for c in (self._in_w, out_w):
                set_pipe_size(c)
            self.thread = threading.Thread(target=core_thread_main, args=(llm, in_r, out_w), name=name, daemon=True)
            self.thread.start()

    @classmethod
    def attach(cls, pipes: tuple[Any, Any], core_pid: int) -> EngineCoreClient:
        """A client over pipes to a running core (Ready already read by whoever spawned it)."""
        self = cls.__new__(cls)
        self._lock = threading.Lock()
        self._reap_lock = threading.Lock()
        self.proc = None
        self.thread = None
        self._in_w, self._out_r = pipes
        self._core_pid = core_pid
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else self._core_pid

    @property
    def spawned(self) -> bool:
        """Is the core a process (ours or attached), not a thread of this process?"""
        return self.thread is None

    def is_alive(self) -> bool:
        if self.proc is not None:
            return not self._exited(0)
        if self._core_pid is not None:
            return _pid_running(self._core_pid)
        assert self.thread is not None
        return self.thread.is_alive()

    def _exited(self, timeout: float | None) -> bool:
        return process_exited(self.proc, timeout)

    def wait_exit(self, timeout: float) -> None:
        """Give an exiting core process `timeout` s, so that its exit code is known (our child only)."""
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
        try:
            return read_ready(self._out_r, self.is_alive, self.exitcode, deadline)
        except TimeoutError:
            self.close(0)
            raise
        except BaseException:
            self.close(10)
            raise

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
        if self._core_pid is not None:
            try:
                self._out_r.close()
            except OSError:
                pass
        elif self.proc is not None:
            stop_process(self.proc, timeout)
            with self._reap_lock:
                self.proc.join(5)  # reap it
        elif self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)


def read_ready(
    out_r: Any, is_alive: Callable[[], bool], exitcode: Callable[[], int | None], deadline: float | None
) -> EngineCoreInfo:
    """The core's first message on one output pipe: its Ready's info; its start-up error raised;
    RuntimeError when it exited without a word, TimeoutError past `deadline` (time.monotonic())."""
    while not out_r.poll(0.2):
        if not is_alive() and not out_r.poll(0):
            raise RuntimeError(f"the engine core exited during start-up (exit code {exitcode()}); see its log above")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("the engine core was not ready in time")
    try:
        msg = out_r.recv()
    except EOFError:
        raise RuntimeError(f"the engine core exited during start-up (exit code {exitcode()})") from None
    if isinstance(msg, StartupError):
        raise msg.error
    assert isinstance(msg, Ready), type(msg).__name__
    return msg.info


class SharedCore:
    """The front process's handle on a core that serves N API processes (`pagedllm serve
    --api-server-count N`): it spawns the core, reads its Ready on every pipe, hands each API
    process its pipes (`pipes[i]`), and reaps the core at the end. It sends nothing itself."""

    def __init__(self, llm_kwargs: dict, num_clients: int):
        self.proc, self.pipes = start_core_process(llm_kwargs, num_clients)

    @property
    def pid(self) -> int:
        pid: int = self.proc.pid
        return pid

    def exited(self, timeout: float | None = 0) -> bool:
        return process_exited(self.proc, timeout)

    def exitcode(self) -> int | None:
        if not self.exited(0):
            return None
        self.proc.join(5)
        code: int | None = self.proc.exitcode
        return code

    def wait_ready(self, timeout: float | None = None) -> EngineCoreInfo:
        """The core's info once it has loaded the model (Ready on every pipe), or its start-up error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            infos = [read_ready(out_r, lambda: not self.exited(0), self.exitcode, deadline) for _, out_r in self.pipes]
        except BaseException:
            self.close(10)
            raise
        return infos[0]

    def close_pipes(self) -> None:
        """Drop this process's copies of the pipes (once the API processes hold theirs)."""
        for pair in self.pipes:
            for conn in pair:
                try:
                    conn.close()
                except OSError:
                    pass

    def close(self, timeout: float | None = 30.0) -> None:
        """Wait for the core to exit (its clients gone), else terminate it; reap it."""
        self.close_pipes()
        stop_process(self.proc, timeout)
        self.proc.join(5)


def process_exited(proc: Any, timeout: float | None) -> bool:
    """Has the core process exited? Read from its sentinel, which never reaps it: waitpid from two
    threads at once (Process.join/is_alive) can make an exited child look alive."""
    from multiprocessing.connection import wait

    return bool(wait([proc.sentinel], timeout))


def stop_process(proc: Any, timeout: float | None) -> None:
    """Give the core `timeout` s to exit, then terminate it, then kill it (not reaped here)."""
    if not process_exited(proc, timeout):
        logger.warning("engine core did not exit in %.0f s; terminating it", timeout or 0)
        proc.terminate()
        if not process_exited(proc, 5):
            proc.kill()
            process_exited(proc, 5)


def _pid_running(pid: int) -> bool:
    """Is the process running (a zombie, exited but not yet reaped by its parent, is not)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: signal 0 tells existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
