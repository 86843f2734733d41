"""Helpers of the reliability suite: `pagedllm serve` as a subprocess (loopback, its log in a
file), an SSE client for many concurrent streams, the engine's gauges from /metrics, and the
process tree (Linux /proc). Every wait here is bounded: nothing can hang a CI run. The bounds are
for hangs, not speeds: generous, since the box may be busy with other work."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from tests.server.helpers import child_pids, metric, pid_alive

MODEL_NAME = "tiny"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK_SIZE = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def process_name(pid: int) -> str:
    """/proc/PID/comm: what pagedllm's processes call themselves (entrypoints/proc_name.py)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, ...)."""
    out, todo = [], [pid]
    while todo:
        for c in child_pids(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive after waiting up to `timeout` seconds for them to exit."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if pid_alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


class ServeProcess:
    """`python -m pagedllm serve` on 127.0.0.1 and a free port, CPU, one torch thread per process
    (the box is small and shared: two threads per process oversubscribe it many times over).
    `log()` is its output so far."""

    def __init__(self, model: str, log_path: str, num_kv_blocks: int, max_num_seqs: int, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.num_kv_blocks = num_kv_blocks
        self.log_path = log_path
        self.cmd = [
            sys.executable,
            "-m",
            "pagedllm",
            "serve",
            "--model",
            model,
            "--device",
            "cpu",
            "--block-size",
            str(BLOCK_SIZE),
            "--num-kv-blocks",
            str(num_kv_blocks),
            "--max-num-seqs",
            str(max_num_seqs),
            "--port",
            str(self.port),
            "--served-model-name",
            MODEL_NAME,
            "--log-level",
            "warning",
            *extra,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> ServeProcess:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        env.pop("PAGEDLLM_API_KEY", None)  # the default set-up: loopback, no key
        self._log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"`pagedllm serve` did not start:\n{self.log()}")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def core_pid(self) -> int:
        """The engine core: the child named pagedllm-core (not an API process, not multiprocessing's
        resource tracker)."""
        cores = [p for p in child_pids(self.pid) if process_name(p) == "pagedllm-core"]
        assert len(cores) == 1, f"expected one engine core below {self.pid}, found {cores}"
        return cores[0]

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if it is still running after `timeout` seconds."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """Kill what is left of the server and its processes (teardown)."""
        if self.proc is not None:
            left = descendants(self.pid) if self.proc.poll() is None else []
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            for p in wait_gone(left, 5):
                os.kill(p, signal.SIGKILL)
        if getattr(self, "_log", None) is not None:
            self._log.close()


# ---- the engine's state from /metrics ---------------------------------------------------------
@dataclasses.dataclass
class Gauges:
    running: float
    waiting: float
    kv_usage: float  # fraction of KV blocks in use
    finished: dict[str, float]  # request_success_total by finished_reason

    def leaked_blocks(self, num_kv_blocks: int) -> int:
        return round(self.kv_usage * num_kv_blocks)

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.kv_usage == 0


def parse_gauges(text: str) -> Gauges:
    from prometheus_client.parser import text_string_to_metric_families

    samples = [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]
    finished: dict[str, float] = {}
    for name, labels, value in samples:
        if name == "pagedllm:request_success_total":
            finished[labels["finished_reason"]] = finished.get(labels["finished_reason"], 0) + value
    return Gauges(
        metric(samples, "pagedllm:num_requests_running"),
        metric(samples, "pagedllm:num_requests_waiting"),
        metric(samples, "pagedllm:kv_cache_usage_perc"),
        finished,
    )


def gauges(url: str) -> Gauges:
    return parse_gauges(httpx.get(url + "/metrics", timeout=10).text)


def wait_idle(url: str, timeout: float = 60.0) -> Gauges:
    """Poll /metrics until nothing runs or waits and no KV block is in use; the last reading
    (the caller asserts `idle`, so a leak fails with the numbers)."""
    deadline = time.monotonic() + timeout
    while True:
        g = gauges(url)
        if g.idle or time.monotonic() > deadline:
            return g
        time.sleep(0.05)


async def wait_gauges(client: httpx.AsyncClient, ok: Any, timeout: float) -> Gauges:
    """Poll /metrics (without blocking the loop) until ok(gauges); the last reading either way."""
    deadline = time.monotonic() + timeout
    while True:
        g = parse_gauges((await client.get("/metrics")).text)
        if ok(g) or time.monotonic() > deadline:
            return g
        await asyncio.sleep(0.05)


# ---- clients ----------------------------------------------------------------------------------
def completion_body(i: int, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    """A completion whose length is known: exactly max_tokens tokens (min_tokens and ignore_eos)."""
    body: dict[str, Any] = dict(
        model=MODEL_NAME,
        prompt=f"def f{i}(x):\n    return",
        max_tokens=max_tokens,
        min_tokens=max_tokens,
        ignore_eos=True,
        temperature=0.8,
        seed=i,
        stream=stream,
    )
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def chat_body(i: int, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    body = completion_body(i, max_tokens, stream)
    del body["prompt"]
    body["messages"] = [{"role": "user", "content": f"Write function number {i}."}]
    return body


@dataclasses.dataclass
class StreamResult:
    status: int = 0
    events: list = dataclasses.field(default_factory=list)  # the parsed `data:` events
    done: bool = False  # [DONE] arrived
    cancelled: bool = False  # the client closed the connection on purpose
    timed_out: bool = False
    transport_error: str | None = None
    body: bytes = b""  # a non-200 answer's body
    ended_at: float = 0.0  # time.monotonic() when the stream ended

    @property
    def error(self) -> dict | None:
        return next((e["error"] for e in self.events if "error" in e), None)

    @property
    def usage(self) -> dict | None:
        return next((e["usage"] for e in reversed(self.events) if e.get("usage")), None)

    @property
    def finish_reasons(self) -> list:
        return [c.get("finish_reason") for e in self.events for c in e.get("choices", ()) if c.get("finish_reason")]


async def stream(
    client: httpx.AsyncClient, path: str, body: dict, cancel_after: int | None = None, timeout: float = 60.0
) -> StreamResult:
    """POST a streamed request and read its SSE events. cancel_after=k: close the connection after
    k events (0: as soon as the headers are in). Never raises for the server's behaviour: the
    result says what happened, within `timeout` seconds."""
    res = StreamResult()

    async def read() -> None:
        async with client.stream("POST", path, json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.body = await r.aread()
                return
            if cancel_after == 0:
                res.cancelled = True
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    res.done = True
                    return
                res.events.append(json.loads(line[6:]))
                if cancel_after is not None and len(res.events) >= cancel_after:
                    res.cancelled = True
                    return

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        res.timed_out = True
    except httpx.HTTPError as e:
        res.transport_error = f"{type(e).__name__}: {e}"
    res.ended_at = time.monotonic()
    return res


def async_client(url: str, timeout: float = 60.0) -> httpx.AsyncClient:
    """One connection per request (no pool limit, no keep-alive), as independent clients are."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits)
