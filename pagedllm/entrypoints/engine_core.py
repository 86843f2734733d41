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
from typing import Any

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.messages import (
    Abort,
    Bye,
    CoreEvent,
    CoreInput,
    EngineCoreInfo,
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

logger = logging.getLogger("pagedllm")

STATS_INTERVAL_S = 0.02  # metrics ride along with step outputs at most this often
IDLE_POLL_S = 1.0  # how often an idle core checks that its parent is still there
PIPE_BYTES = 1 << 20  # pipe buffer (Linux default 64 KiB): a burst of adds never blocks the sender


class EngineCoreProc:
    """The loop: drain requests and aborts, step while work exists, send each step's outputs."""

    def __init__(self, llm: Any, conn_in: Any, conn_out: Any, parent_pid: int | None = None):
        self.llm = llm
        self.core = llm.engine.core  # the EngineCore only: no output processing here
        self.conn_in = conn_in
        self.conn_out = conn_out
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

    def run(self) -> None:
        """Until Shutdown or the parent goes away. Returns normally in both cases."""
        core = self.core
        try:
            while True:
                if not core.has_unfinished_requests():
                    self._send(Stats(self._stats()))
                    while not self.conn_in.poll(IDLE_POLL_S):
                        if self._orphaned():
                            return
                while self.conn_in.poll():  # everything that arrived, then one step
                    if not self._handle(self.conn_in.recv()):
                        return
                if core.has_unfinished_requests():
                    self._step()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return  # the API process is gone
        finally:
            self._abort_all()  # leave no blocks behind (thread mode reuses the LLM)
            if self.timeline is not None:
                self.timeline.close()
                self.core.timeline = None

    def _abort_all(self) -> list[str]:
        ids = self.core.request_ids()
        for rid in ids:
            try:
                self.core.abort_request(rid)
            except Exception:
                logger.exception("engine abort_request failed")
        return ids

    # ---- inputs --------------------------------------------------------------------------
    def _handle(self, msg: CoreInput) -> bool:
        if isinstance(msg, EngineCoreRequest):
            if self.timeline is not None:
                self.timeline.event("core_recv", rid=msg.request_id)
            try:
                self.core.add_request(msg)
            except InvalidRequestError as e:  # checked by the API process: only a reused id lands here
                self._send(Rejected(msg.request_id, e))
            except Exception as e:  # an engine bug: fail this request, keep serving
                logger.exception("engine add_request failed")
                self._send(Failed([msg.request_id], f"engine add_request failed: {e!r}"))
        elif isinstance(msg, Abort):
            for rid in msg.request_ids:
                self.core.abort_request(rid)
        elif isinstance(msg, StopSequences):
            for rid, index in msg.sequences:
                self.core.stop_sequence(rid, index)
        elif isinstance(msg, Shutdown):
            self._abort_all()
            self._send(Bye())
            return False
        else:
            logger.error("engine core: unknown message %r", type(msg).__name__)
        return True

    def _orphaned(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    # ---- the step --------------------------------------------------------------------------
    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as e:  # an engine bug: fail what is in flight, keep serving
            logger.exception("engine step failed; failing %d request(s)", len(self.core.requests))
            self._send(Failed(self._abort_all(), f"engine step failed: {e!r}"))
            return
        now = time.monotonic()
        stats = self._stats(now) if now - self.last_stats >= STATS_INTERVAL_S else None
        if outputs or stats is not None:
            if self.timeline is not None and outputs:
                self.timeline.event("sent", rids=[o.request_id for o in outputs])
            self._send(Step(outputs, stats))

    def _stats(self, now: float | None = None) -> Metrics:
        self.last_stats = time.monotonic() if now is None else now
        return self.core.get_metrics()

    def _send(self, msg: CoreEvent) -> None:
        self.conn_out.send(msg)


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


def core_process_main(conn_in: Any, conn_out: Any, llm_kwargs: dict, parent_pid: int, log_level: int) -> None:
    """Entry point of the spawned core process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
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
        proc = EngineCoreProc(llm, conn_in, conn_out, parent_pid)
        proc._send(Ready(proc.info()))
        proc.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass
    finally:
        llm.close()


def core_thread_main(llm: Any, conn_in: Any, conn_out: Any) -> None:
    """The same loop on a thread of this process, over an existing LLM (whose engine keeps its
    output processor: `llm.generate` still works beside it, one at a time)."""
    try:
        proc = EngineCoreProc(llm, conn_in, conn_out)
        proc._send(Ready(proc.info()))
        proc.run()
    except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
        pass
    except Exception:
        logger.exception("engine core thread crashed")
    finally:
        try:
            conn_out.close()  # the reader sees EOF
        except OSError:
            pass
