"""EngineCore: the engine loop in a process of its own (vLLM v1's split), or in a thread.

The core owns the LLM (scheduler, KV-cache manager, model runner, the device) and nothing
else: requests arrive as token ids, and what goes back is one message per step with every
request's new token ids, finish reasons and timestamps. Tokenizing, validation,
detokenizing, stop strings and HTTP live in the API process (AsyncLLM), so the two halves
no longer take turns on one GIL.

Wire protocol: pickled tuples over two one-way multiprocessing pipes.

  API -> core   ("add", rid, prompt_token_ids, params, arrival_time)
                ("abort", [rid, ...])
                ("shutdown",)
  core -> API   ("ready", info)              once the model is loaded (sizes, metrics)
                ("error", exception)         instead of "ready" when start-up fails
                ("step", entries, stats)     per step; entries are (rid, new_token_ids,
                                             finish_reason, stop_reason, num_cached_tokens,
                                             first_token_time, finish_time); stats is the
                                             metrics dict at most every STATS_INTERVAL_S, else None
                ("stats", stats)             on going idle (gauges drop to 0 at once)
                ("rejected", rid, message)   add_request refused it (ValueError)
                ("failed", [rid, ...], msg)  a step raised; those requests are gone
                ("bye",)                     after "shutdown", before exit

`rid` is the API process's internal id (unique per request, never reused), so an output
still in flight for an aborted request can never be taken for a later one's. Times are
time.monotonic(), one clock for every process of a host.

The core never outlives the API process: its input pipe reads EOF when the parent dies (the
kernel closes the parent's end), and the parent pid is checked while idle and during start-up.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
from typing import Any

logger = logging.getLogger("pagedllm")

STATS_INTERVAL_S = 0.02  # metrics ride along with step outputs at most this often
IDLE_POLL_S = 1.0  # how often an idle core checks that its parent is still there
PIPE_BYTES = 1 << 20  # pipe buffer (Linux default 64 KiB): a burst of adds never blocks the sender


class EngineCore:
    """The loop: drain requests and aborts, step while work exists, send each step's outputs."""

    def __init__(self, llm: Any, conn_in, conn_out, parent_pid: int | None = None):
        self.llm = llm
        self.engine = llm.engine
        self.conn_in = conn_in
        self.conn_out = conn_out
        self.parent_pid = parent_pid
        self.sent: dict[str, int] = {}  # live request -> output tokens already sent
        self.last_stats = 0.0

    def info(self) -> dict:
        engine = self.engine
        cfg = engine.config
        return {
            "pid": os.getpid(),
            "model_path": getattr(self.llm, "model_path", None),
            "max_model_len": cfg.max_model_len,
            "block_size": cfg.block_size,
            "num_kv_blocks": engine.kv.num_blocks,
            "vocab_size": engine.vocab_size,
            "metrics": engine.get_metrics(),
        }

    def run(self) -> None:
        """Until "shutdown" or the parent goes away. Returns normally in both cases."""
        engine = self.engine
        try:
            while True:
                if not engine.has_unfinished_requests():
                    self._send(("stats", self._stats()))
                    while not self.conn_in.poll(IDLE_POLL_S):
                        if self._orphaned():
                            return
                while self.conn_in.poll():  # everything that arrived, then one step
                    if not self._handle(self.conn_in.recv()):
                        return
                if engine.has_unfinished_requests():
                    self._step()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return  # the API process is gone
        finally:
            for rid in list(self.sent):  # leave no blocks behind (thread mode reuses the LLM)
                engine.abort_request(rid)
            self.sent.clear()

    # ---- inputs --------------------------------------------------------------------------
    def _handle(self, msg: tuple) -> bool:
        kind = msg[0]
        if kind == "add":
            _, rid, ids, params, arrival = msg
            try:
                self.engine.add_request(rid, ids, params, arrival_time=arrival, stream=True)
            except ValueError as e:  # validated by the API process: a safety net
                self._send(("rejected", rid, str(e)))
                return True
            except Exception as e:  # an engine bug: fail this request, keep serving
                logger.exception("engine add_request failed")
                self._send(("failed", [rid], f"engine add_request failed: {e!r}"))
                return True
            self.sent[rid] = 0
        elif kind == "abort":
            for rid in msg[1]:
                if self.sent.pop(rid, None) is not None:
                    self.engine.abort_request(rid)
        elif kind == "shutdown":
            for rid in list(self.sent):
                self.engine.abort_request(rid)
            self.sent.clear()
            self._send(("bye",))
            return False
        else:
            logger.error("engine core: unknown message %r", kind)
        return True

    def _orphaned(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    # ---- the step --------------------------------------------------------------------------
    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:  # an engine bug: fail what is in flight, keep serving
            logger.exception("engine step failed; failing %d request(s)", len(self.sent))
            rids = list(self.sent)
            for rid in rids:
                try:
                    self.engine.abort_request(rid)
                except Exception:
                    pass
            self.sent.clear()
            self._send(("failed", rids, f"engine step failed: {e!r}"))
            return
        sent = self.sent
        entries = []
        for out in outs:
            rid = out.request_id
            n = sent.get(rid)
            if n is None:
                continue
            o = out.outputs[0]
            ids = o.token_ids
            if out.finished:
                del sent[rid]
            else:
                sent[rid] = len(ids)
            m = out.metrics
            entries.append(
                (
                    rid,
                    ids[n:] if n else ids,
                    o.finish_reason,
                    o.stop_reason,
                    out.num_cached_tokens,
                    m.first_token_time if m else None,
                    m.finish_time if m else None,
                )
            )
        now = time.monotonic()
        stats = None
        if now - self.last_stats >= STATS_INTERVAL_S:
            stats = self._stats(now)
        if entries or stats is not None:
            self._send(("step", entries, stats))

    def _stats(self, now: float | None = None) -> dict:
        self.last_stats = time.monotonic() if now is None else now
        return self.engine.get_metrics()

    def _send(self, msg: tuple) -> None:
        self.conn_out.send(msg)


# ---- running it -------------------------------------------------------------------------------
def _set_pipe_size(conn) -> None:
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


def core_process_main(conn_in, conn_out, llm_kwargs: dict, parent_pid: int, log_level: int) -> None:
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
        # Detokenization happens in the API process: the engine only hands out token ids.
        llm.engine.detokenize = False
    except BaseException as e:  # noqa: BLE001  (reported to the parent)
        if not isinstance(e, ValueError):
            logger.exception("engine core start-up failed")
        try:
            conn_out.send(("error", _picklable(e)))
        except Exception:
            pass
        sys.exit(1)
    started.set()
    try:
        core = EngineCore(llm, conn_in, conn_out, parent_pid)
        core._send(("ready", core.info()))
        core.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass
    finally:
        llm.close()


def core_thread_main(llm: Any, conn_in, conn_out) -> None:
    """The same loop on a thread of this process, over an existing LLM (whose engine keeps its
    tokenizer: `llm.generate` still works beside it)."""
    try:
        core = EngineCore(llm, conn_in, conn_out)
        core._send(("ready", core.info()))
        core.run()
    except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
        pass
    except Exception:
        logger.exception("engine core thread crashed")
    finally:
        try:
            conn_out.close()  # the reader sees EOF
        except OSError:
            pass


class EngineCoreClient:
    """The API process's end of the pipes: start the core, send to it (thread-safe), receive
    from it (one reader), stop it."""

    def __init__(self, *, llm_kwargs: dict | None = None, llm: Any = None, name: str = "pagedllm-engine-core"):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # CUDA cannot survive fork
        in_r, in_w = ctx.Pipe(duplex=False)  # API -> core
        out_r, out_w = ctx.Pipe(duplex=False)  # core -> API
        for c in (in_w, out_w):
            _set_pipe_size(c)
        self._in_w, self._out_r = in_w, out_r
        self._lock = threading.Lock()
        self._reap_lock = threading.Lock()
        self.proc = None
        self.thread = None
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
        return not self._exited(0) if self.proc is not None else self.thread.is_alive()

    def _exited(self, timeout: float | None) -> bool:
        """Has the core process exited? Read from its sentinel, which never reaps it: waitpid
        from two threads at once (Process.join/is_alive) can make an exited child look alive."""
        from multiprocessing.connection import wait

        return bool(wait([self.proc.sentinel], timeout))

    def exitcode(self) -> int | None:
        if self.proc is None or not self._exited(0):
            return None
        with self._reap_lock:
            self.proc.join(5)  # closed its pipes: exits (reapable) at once
            return self.proc.exitcode

    def wait_ready(self, timeout: float | None = None) -> dict:
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
        if msg[0] == "error":
            self.close(10)
            raise msg[1]
        assert msg[0] == "ready", msg[0]
        return msg[1]

    def send(self, msg: tuple) -> None:
        """Raises OSError (BrokenPipeError) when the core is gone."""
        with self._lock:
            self._in_w.send(msg)

    def recv(self) -> tuple:
        """Raises EOFError when the core is gone."""
        return self._out_r.recv()

    def poll(self, timeout: float | None = 0) -> bool:
        return self._out_r.poll(timeout)

    def fileno(self) -> int:
        return self._out_r.fileno()

    def close(self, timeout: float | None = 30.0) -> None:
        """Wait for the core to exit (after "shutdown"), else terminate it; close the pipes."""
        try:
            self._in_w.close()  # EOF: a core that missed "shutdown" exits too
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
