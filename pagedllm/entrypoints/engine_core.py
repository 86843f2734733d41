"""The engine core's loop, in a process of its own (vLLM v1's split) or on a thread.

The loop owns an EngineCore (engine/core.py: scheduler, KV-cache manager, model runner, the
device) and nothing else: requests arrive checked, as EngineCoreRequests with token ids, and
what goes back is one Step message per step with every sequence's new token ids, finish
reasons and timestamps (engine/messages.py has every message). Tokenizing, validation,
detokenizing, stop strings and HTTP live in the API process (async_llm.py), so the two halves
no longer take turns on one GIL. The client end is core_client.py.

The core never outlives the API process: its input pipe reads EOF when the parent dies (the
kernel closes the parent's end), and the parent pid is checked while idle and during start-up.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import wait
from typing import Any

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.messages import (
    Abort,
    Bye,
    CoreEvent,
    CoreInput,
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreRequest,
    Failed,
    Metrics,
    Ready,
    Rejected,
    Shutdown,
    StartupError,
    Stats,
    Step,
    StopSequences,
)
from pagedllm.engine.timeline import timeline_from_env
from pagedllm.entrypoints.proc_name import set_process_name

logger = logging.getLogger("pagedllm")

STATS_INTERVAL_S = 0.02  # metrics ride along with step outputs at most this often
IDLE_POLL_S = 1.0  # how often an idle core checks that its parent is still there
PIPE_BYTES = 1 << 20  # pipe buffer (Linux default 64 KiB): a burst of adds never blocks the sender


class CoreClient:
    """One API process's two pipes, and the requests it sent that the core still holds."""

    def __init__(self, index: int, conn_in: Any, conn_out: Any):
        self.index = index
        self.conn_in = conn_in
        self.conn_out = conn_out
        self.request_ids: set[str] = set()


class EngineCoreProc:
    """The loop: drain requests and aborts, step while work exists, send each step's outputs.

    It serves one API process or several (`pagedllm serve --api-server-count N`), each over its
    own pair of pipes. Invariant: `self.route[rid]` is the client that sent request `rid`, for
    every request the core holds (the ids are unique across clients: each API process prefixes
    its own); a step's outputs go to the clients of their requests, the metrics to every client.
    A client that says Shutdown, or whose pipe ends, loses its requests (aborted: their blocks
    freed) and is dropped; the loop returns once no client is left."""

    def __init__(self, llm: Any, clients: list[tuple[Any, Any]], parent_pid: int | None = None):
        self.llm = llm
        self.core = llm.engine.core  # the EngineCore only: no output processing here
        self.clients = [CoreClient(i, conn_in, conn_out) for i, (conn_in, conn_out) in enumerate(clients)]
        self.route: dict[str, CoreClient] = {}
        self.parent_pid = parent_pid
        self.last_stats = 0.0
        self.timeline = timeline_from_env("core")  # PAGEDLLM_TIMELINE: the latency breakdown's core half
        self.core.timeline = self.timeline

    def info(self) -> EngineCoreInfo:
        core = self.core
        return EngineCoreInfo(
            pid=os.getpid(),
            model_path=getattr(self.llm, "model_path", None),
            max_model_len=core.config.max_model_len,
            block_size=core.config.block_size,
            num_kv_blocks=core.kv.num_blocks,
            vocab_size=self.llm.engine.vocab_size,
            max_num_seqs=core.config.max_num_seqs,
            max_num_batched_tokens=core.config.max_num_batched_tokens,
            kv_cache_groups=core.kv.groups,
            metrics=core.get_metrics(),
            eos_token_ids=tuple(sorted(core.scheduler.eos_token_ids)),
        )

    def send_ready(self) -> None:
        ready = Ready(self.info())
        for client in list(self.clients):
            self._send(client, ready)

    def run(self) -> None:
        """Until every client said Shutdown or went away, or the parent went away. Returns
        normally in every case."""
        core = self.core
        try:
            while self.clients:
                if not core.has_unfinished_requests():
                    self._forget_all()  # a request that ended without an output: no stale route
                    self._broadcast_stats()
                    while self.clients and not wait([c.conn_in for c in self.clients], IDLE_POLL_S):
                        if self._orphaned():
                            return
                for client in list(self.clients):  # everything that arrived, then one step
                    self._drain(client)
                if core.has_unfinished_requests():
                    self._step()
        finally:
            self._abort_all()  # leave no blocks behind (thread mode reuses the LLM)
            if self.timeline is not None:
                self.timeline.close()
                self.core.timeline = None

    def _drain(self, client: CoreClient) -> None:
        try:
            while client in self.clients and client.conn_in.poll():
                self._handle(client, client.conn_in.recv())
        except (EOFError, OSError):  # that API process is gone
            self._drop(client)

    def _drop(self, client: CoreClient) -> None:
        """Forget a client: abort its requests (their blocks freed), close its pipes."""
        if client not in self.clients:
            return
        self.clients.remove(client)
        for rid in list(client.request_ids):
            self._abort(rid)
        for conn in (client.conn_in, client.conn_out):
            try:
                conn.close()
            except OSError:
                pass

    def _abort(self, rid: str) -> None:
        client = self.route.pop(rid, None)
        if client is not None:
            client.request_ids.discard(rid)
        try:
            self.core.abort_request(rid)
        except Exception:
            logger.exception("engine abort_request failed")

    def _abort_all(self) -> list[str]:
        ids = self.core.request_ids()
        for rid in ids:
            self._abort(rid)
        return ids

    # ---- inputs --------------------------------------------------------------------------
    def _handle(self, client: CoreClient, msg: CoreInput) -> None:
        if isinstance(msg, EngineCoreRequest):
            rid = msg.request_id
            if self.timeline is not None:
                self.timeline.event("core_recv", rid=rid)
            try:
                self.core.add_request(msg)
            except InvalidRequestError as e:  # checked by the API process: only a reused id lands here
                self._send(client, Rejected(rid, e))
                return
            except Exception as e:  # an engine bug: fail this request, keep serving
                logger.exception("engine add_request failed")
                self._send(client, Failed([rid], f"engine add_request failed: {e!r}"))
                return
            self.route[rid] = client
            client.request_ids.add(rid)
        elif isinstance(msg, Abort):
            for rid in msg.request_ids:
                if self.route.get(rid) is client:
                    self._abort(rid)
        elif isinstance(msg, StopSequences):
            for rid, index in msg.sequences:
                if self.route.get(rid) is client:
                    self.core.stop_sequence(rid, index)
                    if rid not in self.core.requests:  # that was its last sequence
                        self._forget(rid)
        elif isinstance(msg, Shutdown):
            for rid in list(client.request_ids):
                self._abort(rid)
            self._send(client, Bye())
            self._drop(client)
        else:
            logger.error("engine core: unknown message %r", type(msg).__name__)

    def _forget(self, rid: str) -> None:
        client = self.route.pop(rid, None)
        if client is not None:
            client.request_ids.discard(rid)

    def _forget_all(self) -> None:
        if self.route:
            self.route.clear()
            for client in self.clients:
                client.request_ids.clear()

    def _orphaned(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    # ---- the step --------------------------------------------------------------------------
    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as e:  # an engine bug: fail what is in flight, keep serving
            logger.exception("engine step failed; failing %d request(s)", len(self.core.requests))
            failed: dict[int, list[str]] = {}
            for rid in self.core.request_ids():
                client = self.route.get(rid)
                if client is not None:
                    failed.setdefault(client.index, []).append(rid)
            self._abort_all()
            for client in list(self.clients):
                if client.index in failed:
                    self._send(client, Failed(failed[client.index], f"engine step failed: {e!r}"))
            return
        now = time.monotonic()
        stats = self._stats(now) if now - self.last_stats >= STATS_INTERVAL_S else None
        if self.timeline is not None and outputs:
            self.timeline.event("sent", rids=[o.request_id for o in outputs])
        requests = self.core.requests
        if len(self.clients) == 1:  # the usual case: no sorting
            client = self.clients[0]
            for o in outputs:
                if o.finish_reason is not None and o.request_id not in requests:
                    self._forget(o.request_id)
            if outputs or stats is not None:
                self._send(client, Step(outputs, stats))
            return
        by_client: dict[int, list[EngineCoreOutput]] = {}
        route = self.route
        ended = []
        for o in outputs:
            owner = route.get(o.request_id)
            if owner is None:
                continue
            by_client.setdefault(owner.index, []).append(o)
            if o.finish_reason is not None and o.request_id not in requests:
                ended.append(o.request_id)  # after the loop: its other sequences may end in this step too
        for rid in ended:
            self._forget(rid)
        for client in list(self.clients):
            mine = by_client.get(client.index)
            if mine:
                self._send(client, Step(mine, stats))
            elif stats is not None:
                self._send(client, Stats(stats))

    def _broadcast_stats(self) -> None:
        stats = Stats(self._stats())
        for client in list(self.clients):
            self._send(client, stats)

    def _stats(self, now: float | None = None) -> Metrics:
        self.last_stats = time.monotonic() if now is None else now
        return self.core.get_metrics()

    def _send(self, client: CoreClient, msg: CoreEvent) -> None:
        try:
            client.conn_out.send(msg)
        except (OSError, ValueError):  # that API process is gone (BrokenPipeError) or its pipe closed
            self._drop(client)


# ---- running it -------------------------------------------------------------------------------
def set_pipe_size(conn: Any) -> None:
    try:
        import fcntl

        fcntl.fcntl(conn.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (ImportError, OSError, ValueError):
        pass  # not Linux, or above /proc/sys/fs/pipe-max-size


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _watch_parent(parent_pid: int, stop: threading.Event) -> None:
    """During start-up (loading weights, capturing CUDA graphs: minutes on a big model) the loop
    is not polling yet; exit if the parent dies meanwhile."""
    while not stop.wait(IDLE_POLL_S):
        if os.getppid() != parent_pid:
            os._exit(1)


def core_process_main(
    clients: list[tuple[Any, Any]], llm_kwargs: dict, parent_pid: int, log_level: int, name: str = "pagedllm-core"
) -> None:
    """Entry point of the spawned core process: `clients` holds each API process's (input, output)
    pipe ends, one pair per API process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    set_process_name(name)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter(
                f"%(levelname)s %(asctime)s [engine core pid {os.getpid()}] %(message)s", "%m-%d %H:%M:%S"
            )
        )
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(log_level)
    started = threading.Event()
    threading.Thread(
        target=_watch_parent, args=(parent_pid, started), name="pagedllm-core-watchdog", daemon=True
    ).start()
    try:
        from pagedllm.entrypoints.llm import LLM

        llm = LLM(**llm_kwargs)
    except BaseException as e:  # noqa: BLE001  (reported to the parent)
        if not isinstance(e, ValueError):
            logger.exception("engine core start-up failed")
        for _, conn_out in clients:
            try:
                conn_out.send(StartupError(_picklable(e)))
            except Exception:
                pass
        sys.exit(1)
    started.set()
    # This process lives as long as its engine: the start-up heap (modules, tokenizer, KV bookkeeping)
    # leaves the garbage collector's generations for good, so a full collection while serving walks
    # only the requests' objects (a full collection of that heap: ~110 ms on a 2-core host).
    gc.collect()
    gc.freeze()
    try:
        proc = EngineCoreProc(llm, clients, parent_pid)
        proc.send_ready()
        proc.run()
    finally:
        llm.close()


def core_thread_main(llm: Any, conn_in: Any, conn_out: Any) -> None:
    """The same loop on a thread of this process, over an existing LLM (whose engine keeps its
    output processor: `llm.generate` still works beside it, one at a time)."""
    try:
        proc = EngineCoreProc(llm, [(conn_in, conn_out)])
        proc.send_ready()
        proc.run()
    except Exception:
        logger.exception("engine core thread crashed")
    finally:
        try:
            conn_out.close()  # the reader sees EOF
        except OSError:
            pass
