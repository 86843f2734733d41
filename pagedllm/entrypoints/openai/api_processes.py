"""`pagedllm serve --api-server-count N`: N API processes over one engine core.

    front process (this module's run_api_servers: binds, spawns, supervises; serves nothing)
      |-- engine core process (engine_core.py): one pair of pipes per API process
      |-- API process 0 ... N-1 (api_process_main): uvicorn + AsyncLLM attached to the core,
            each listening on its own SO_REUSEPORT socket of the one port

Each API process parses, tokenizes, detokenizes and streams on its own event loop and GIL, so
the server's ceiling is no longer one core's worth of Python (docs/server.md, "API processes").
What holds across the processes:
- request ids: the core ids carry the process's index (`"1.42"`), so they never collide;
- `--max-queue-len` counts the waiting requests of every process (a shared array of N counts);
- /metrics: the engine's gauges and counters come from the core (every process sees the same),
  the request histograms and counters from every process (prometheus_client's multiprocess
  mode over PROMETHEUS_MULTIPROC_DIR, a temporary directory unless set);
- SIGTERM/SIGINT to the front: each API process gets SIGTERM, aborts its streams (they end
  cleanly), says Shutdown to the core; the core exits once every API process has; exit 0;
- the engine core dying: every API process ends its streams with an error and exits, and the
  front exits 1 (with --keep-alive-on-engine-death they keep answering 503 until SIGTERM);
- an API process dying unasked: the core frees its requests, the front stops the others and
  exits 1, so that a supervisor restarts the whole server;
- the front dying: the core and the API processes see their parent gone and exit.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from multiprocessing.connection import wait
from typing import Any

from pagedllm import envs
from pagedllm.entrypoints.args import USAGE_ERROR, CLIError, engine_kwargs
from pagedllm.entrypoints.async_llm import AsyncLLM
from pagedllm.entrypoints.core_client import CoreAttachment, SharedCore
from pagedllm.entrypoints.logs import LOG_DATEFMT
from pagedllm.entrypoints.openai.http_server import announce, bind_socket_groups, serve, served_names
from pagedllm.entrypoints.proc_name import set_process_name

logger = logging.getLogger("pagedllm")

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode reads it at import
PARENT_POLL_S = 1.0


def run_api_servers(args: argparse.Namespace, template: str | None, tool_parser: str | None, keep_alive: bool) -> int:
    """The front process: bind N sockets on the port, start the core for N clients, start the N
    API processes, supervise them (module docstring). Returns 0 after SIGTERM/SIGINT; CLIError
    when the port is taken, the engine died or an API process died."""
    count = args.api_server_count
    if not args.engine_process:
        raise CLIError(
            f"--api-server-count {count} needs the engine core in its own process: drop --no-engine-process",
            USAGE_ERROR,
        )
    groups = bind_socket_groups(args.host, args.port, count)  # before the model loads
    model, llm_kwargs = _model_and_kwargs(args)
    metrics_dir, own_dir = _metrics_dir()
    core: SharedCore | None = None
    try:
        core = SharedCore({"model": model, **llm_kwargs}, count)
        info = core.wait_ready()
    except BaseException:
        if core is not None:
            core.close(0)
        _close_groups(groups)
        if own_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
        raise
    ctx = multiprocessing.get_context("spawn")
    waiting = ctx.Array("q", count, lock=False)
    procs = []
    for i in range(count):
        attach = CoreAttachment(core.pipes[i], core.pid, info, i, waiting)
        p = ctx.Process(
            target=api_process_main,
            name=f"pagedllm-api-{i}",
            args=(i, args, groups[i], attach, template, tool_parser, keep_alive, model, llm_kwargs, os.getpid()),
        )
        p.start()
        procs.append(p)
    core.close_pipes()  # the API processes hold theirs: EOF reaches each side when the other dies
    announce(groups[0], served_names(args, info.model_path), args.api_key or envs.api_key(), count)
    _close_groups(groups)
    try:
        outcome = Supervisor(core, procs, keep_alive, args.timeout_graceful_shutdown).run()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        core.close(30)
        if own_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    if outcome is not None:
        raise CLIError(outcome)
    return 0


class Supervisor:
    """Waits on the core and the API processes; decides how the server ends (module docstring)."""

    def __init__(self, core: SharedCore, procs: list[Any], keep_alive: bool, graceful_s: float):
        self.core = core
        self.procs = procs
        self.keep_alive = keep_alive
        self.graceful_s = graceful_s
        self.signalled = False
        self.stopping_since: float | None = None  # when the API processes were told to stop
        self.outcome: str | None = None  # why the server failed, or None

    def run(self) -> str | None:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            engine_died = False
            while any(p.exitcode is None for p in self.procs):
                wait([p.sentinel for p in self.procs] + [self.core.proc.sentinel], 0.2)
                if self.signalled and self.stopping_since is None:
                    self._stop_all()
                # the core exits by itself once every API process has said Shutdown: not a death then
                if not engine_died and self.stopping_since is None and self.core.exited(0):
                    engine_died = True
                    code = self.core.exitcode()
                    reason = f"the engine core process died (exit code {code})"
                    logger.error("%s", reason)
                    if not self.keep_alive:  # the API processes stop by themselves
                        self.outcome = (
                            f"{reason}: the server has stopped so that it can be restarted "
                            "(--keep-alive-on-engine-death keeps it serving 503s instead)"
                        )
                        self.stopping_since = time.monotonic()
                for i, p in enumerate(self.procs):
                    if p.exitcode is not None and self.stopping_since is None and not engine_died:
                        self.outcome = f"API process {i} exited unexpectedly (exit code {p.exitcode})"
                        logger.error("%s; stopping the others", self.outcome)
                        self._stop_all()
                if self.stopping_since is not None and time.monotonic() - self.stopping_since > self.graceful_s + 20:
                    for p in self.procs:
                        if p.exitcode is None:
                            logger.warning("API process %s did not stop; killing it", p.name)
                            p.kill()
                    self.stopping_since = time.monotonic()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.outcome

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = True

    def _stop_all(self) -> None:
        self.stopping_since = time.monotonic()
        for p in self.procs:
            if p.exitcode is None:
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass


def api_process_main(
    index: int,
    args: argparse.Namespace,
    sockets: list[socket.socket],
    attach: CoreAttachment,
    template: str | None,
    tool_parser: str | None,
    keep_alive: bool,
    model: str,
    llm_kwargs: dict,
    parent_pid: int,
) -> None:
    """One API process: AsyncLLM attached to the shared core, then serve() on its own sockets."""
    os.setpgrp()  # Ctrl-C reaches the front only; the front tells each API process (SIGTERM)
    set_process_name(f"pagedllm-api-{index}")
    if not logger.handlers:
        logging.basicConfig(format=f"%(levelname)s %(asctime)s [api {index}] %(message)s", datefmt=LOG_DATEFMT)
    logger.setLevel(getattr(logging, str(args.log_level).upper(), logging.INFO))
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="pagedllm-api-watchdog", daemon=True).start()
    try:
        async_llm = AsyncLLM(
            model,
            attach=attach,
            max_queue_len=args.max_queue_len,
            stream_interval=args.stream_interval,
            log_requests=args.log_requests,
            log_stats=index == 0,  # one throughput line for the server, not N
            **llm_kwargs,
        )
        code = serve(args, sockets, async_llm, template, tool_parser, keep_alive, announce_it=False)
    except CLIError as e:
        print(f"pagedllm: error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.code)
    sys.exit(code)


def _watch_parent(parent_pid: int) -> None:
    """The front died (killed): stop as on SIGTERM, so that open streams end and the core is told."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)
            return


def _model_and_kwargs(args: argparse.Namespace) -> tuple[str, dict]:
    """The model resolved once (a hub id to its local snapshot) and the other engine arguments."""
    from pagedllm import default_model_path
    from pagedllm.entrypoints.model_dir import resolve_model_path

    kwargs = engine_kwargs(args)
    model = kwargs.pop("model", None) or default_model_path()
    model = resolve_model_path(model, kwargs.pop("revision", None), kwargs.pop("download_dir", None))
    if kwargs.get("tokenizer") is not None:
        kwargs["tokenizer"] = resolve_model_path(kwargs["tokenizer"], param="tokenizer")
    return model, kwargs


def _metrics_dir() -> tuple[str, bool]:
    """prometheus_client's multiprocess directory: $PROMETHEUS_MULTIPROC_DIR if set, else a new
    temporary one (removed at exit). Set in the environment before the API processes start."""
    path = os.environ.get(METRICS_DIR_ENV)
    if path:
        os.makedirs(path, exist_ok=True)
        return path, False
    path = tempfile.mkdtemp(prefix="pagedllm-metrics-")
    os.environ[METRICS_DIR_ENV] = path
    return path, True


def _close_groups(groups: list[list[socket.socket]]) -> None:
    for group in groups:
        for sock in group:
            sock.close()
