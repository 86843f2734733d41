"""One `pagedllm serve` process (the default set-up: loopback, no key) through a whole working
life, in order: hundreds of idle sockets are opened and stay open while it serves; many
concurrent streams on both endpoints, half of them cancelled by their client mid-stream; a
seeded fuzzer over both endpoints' bodies and the HTTP edge; the idle sockets closed by the
server; a log without a traceback; SIGTERM under load (exit 0, no orphan process).

After each load the engine must be idle again: nothing running or waiting, no KV block in use
(read from /metrics, polled with a bound)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import signal
import socket
import time

import httpx
import pytest

from tests.reliability import fuzz
from tests.reliability.helpers import (
    MODEL_NAME,
    ServeProcess,
    async_client,
    chat_body,
    completion_body,
    descendants,
    gauges,
    stream,
    wait_gauges,
    wait_gone,
    wait_idle,
)

MAX_NUM_SEQS = 32  # fewer than the streams: some of them wait, and are cancelled while waiting
CANCELLED_TOKENS = 1000  # a cancelled stream would run this long if its cancel were lost
IDLE_CLOSE_BOUND_S = 60.0  # idle connections closed by the server within this (keep-alive: 5 s; a bound for a hang)


# two API processes: the slow job (.ci/run runs it after the README command); the README command keeps
# N = 1 here and tests/server/test_api_server_count.py for two API sides over one core
@pytest.fixture(
    scope="module",
    params=[pytest.param(1, id="api-servers-1"), pytest.param(2, id="api-servers-2", marks=pytest.mark.slow)],
)
def server(reliability_model, tmp_path_factory, request):
    """One API process, and two over one engine core (--api-server-count 2): the connections spread
    over both, so a cancel or a disconnect is handled by either, and the gauges are the core's."""
    log = tmp_path_factory.mktemp("serve_under_load") / "server.log"
    srv = ServeProcess(reliability_model, str(log), 4096, MAX_NUM_SEQS, "--api-server-count", str(request.param))
    yield srv.start()
    srv.stop()


@dataclasses.dataclass
class IdleSockets:
    socks: list[socket.socket]
    opened_at: float


@pytest.fixture(scope="module")
def idle_sockets(server, sizes):
    """Connections that never send a byte, open from the first test of the module on."""
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(sizes.idle_sockets)]
    yield IdleSockets(socks, time.monotonic())
    for s in socks:
        s.close()


def normal_request(url: str) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def test_idle_sockets_do_not_stall_requests(server, idle_sockets, figures):
    """Served (not refused, not hung: the client's timeout is a bound for a hang) beside them."""
    t0 = time.monotonic()
    r = normal_request(server.url)
    seconds = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    figures.append(f"idle sockets: {len(idle_sockets.socks)} open; a 4-token request served in {seconds:.2f} s")


def test_concurrent_streams_half_cancelled_lose_nothing_and_leak_nothing(server, sizes, figures):
    """N streams over both endpoints; every other pair cancelled after k events (k = 0: as soon as
    the headers are in, often while still waiting). Every other stream ends with exactly
    stream_tokens tokens, finish_reason "length" and [DONE]; the engine ends idle; the abort and
    length counters grew by exactly the cancelled and completed counts."""
    rng = random.Random(sizes.fuzz_seed)
    plan = []  # (path, body, cancel_after)
    for i in range(sizes.streams):
        cancel = (i // 2) % 2 == 1
        tokens = CANCELLED_TOKENS if cancel else sizes.stream_tokens
        path, body = (
            ("/v1/chat/completions", chat_body(i, tokens)) if i % 2 else ("/v1/completions", completion_body(i, tokens))
        )
        plan.append((path, body, rng.choice([0, 1, 2, 3, 5, 8]) if cancel else None))
    before = gauges(server.url)
    timeout = 300.0 if sizes.soak else 120.0  # a bound for a hang

    async def run():
        async with async_client(server.url, timeout) as c:
            return await asyncio.gather(*(stream(c, p, b, k, timeout) for p, b, k in plan))

    t0 = time.monotonic()
    results = asyncio.run(run())
    seconds = time.monotonic() - t0
    after = wait_idle(server.url)

    lost, cancelled = [], 0
    for (path, body, k), r in zip(plan, results, strict=True):
        if k is not None:
            cancelled += 1
            if not (r.status == 200 and r.cancelled and r.error is None and not r.finish_reasons):
                lost.append(f"{path} cancel after {k}: {r}")
            continue
        usage = r.usage or {}
        if not (
            r.status == 200
            and r.done
            and r.error is None
            and usage.get("completion_tokens") == sizes.stream_tokens
            and r.finish_reasons == ["length"]
        ):
            lost.append(f"{path} seed {body['seed']}: {r}")
    completed = len(plan) - cancelled

    def counted(g):
        grew = {k: g.finished.get(k, 0) - before.finished.get(k, 0) for k in ("abort", "length")}
        return grew == {"abort": cancelled, "length": completed}

    final = asyncio.run(_poll(server.url, counted))
    leaked = after.leaked_blocks(server.num_kv_blocks)
    figures.append(
        f"streams: {len(plan)} concurrent requests ({cancelled} cancelled by the client), {len(lost)} lost, "
        f"{leaked} leaked KV blocks, {seconds:.1f} s"
    )
    assert not lost, f"{len(lost)} streams lost or wrong:\n" + "\n".join(lost[:20])
    assert after.idle, f"the engine is not idle afterwards: {after} ({leaked} KV blocks in use)"
    assert counted(final), f"finish counters grew by {final.finished} from {before.finished}"


async def _poll(url, ok, timeout: float = 60.0):
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        return await wait_gauges(c, ok, timeout)


def _disconnect_mid_body(port: int) -> None:
    """Clients that announce a body and go away after part of it (the log must stay clean)."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            s.sendall((head + "Content-Length: 1000\r\n\r\n").encode() + b'{"prompt": "abc')
    time.sleep(0.2)


@pytest.mark.parametrize("endpoint", ["completions", "chat", "http"])
def test_fuzzed_requests_get_4xx_in_openai_schema_never_5xx(server, sizes, figures, endpoint):
    if endpoint == "http":
        cases = fuzz.http_cases(server.port)
    else:
        cases = fuzz.body_cases(endpoint, sizes.fuzz_cases, sizes.fuzz_seed)
    t0 = time.monotonic()
    outcomes = asyncio.run(fuzz.run_cases(server.url, cases, sizes.fuzz_concurrency))
    seconds = time.monotonic() - t0
    if endpoint == "http":
        _disconnect_mid_body(server.port)
    figures.append(fuzz.summary(f"{endpoint} (seed {sizes.fuzz_seed})", outcomes, seconds))
    problems = [f"{o.case.name} [{o.case.expect}]: {o.problem}" for o in outcomes if o.problem is not None]

    # and afterwards the server still serves, and nothing of the fuzz is left in the engine
    after = wait_idle(server.url)
    r = normal_request(server.url)
    if r.status_code != 200:
        problems.append(f"a normal request after the fuzz got {r.status_code}: {r.text[:200]}")
    if not after.idle:
        problems.append(f"the engine is not idle after the fuzz: {after}")
    assert not problems, f"{len(problems)} of {len(cases)} answers wrong (seed {sizes.fuzz_seed}):\n" + "\n".join(
        problems[:60]
    )


def test_idle_sockets_are_closed_by_the_server(server, idle_sockets, figures):
    deadline = idle_sockets.opened_at + IDLE_CLOSE_BOUND_S
    open_ = list(idle_sockets.socks)
    for s in open_:
        s.setblocking(False)
    while True:  # checked at least once, however long the tests in between took
        open_ = [s for s in open_ if not _closed_by_peer(s)]
        if not open_ or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    closed = len(idle_sockets.socks) - len(open_)
    figures.append(
        f"idle sockets: {closed} of {len(idle_sockets.socks)} closed by the server within {IDLE_CLOSE_BOUND_S:.0f} s"
    )
    assert not open_, f"{len(open_)} of {len(idle_sockets.socks)} idle connections still open after the bound"


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        while True:
            data = s.recv(65536)  # an answer (a 408, say) is allowed before the close
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def test_server_log_has_no_traceback(server):
    """Cancelled streams, fuzzed bodies and clients that leave mid-body are normal traffic:
    nothing of it may be logged as an unhandled error."""
    log = server.log()
    at = log.find("Traceback")
    assert at < 0, f"the server logged a traceback:\n{log[max(0, at - 300) : at + 1500]}"


def test_sigterm_under_load_exits_0_without_orphans(server, sizes, figures):
    """Streams running and waiting when SIGTERM arrives: each ends with finish_reason "abort" and
    [DONE], the process exits 0, and its engine core (every process below it) is gone. (A stream
    that SIGTERM did not end would run its 1,000 tokens to "length"; the waits bound hangs.)"""
    n = sizes.sigterm_streams
    plan = [
        ("/v1/chat/completions", chat_body(i, 1000)) if i % 2 else ("/v1/completions", completion_body(i, 1000))
        for i in range(n)
    ]
    running = min(n, MAX_NUM_SEQS)

    async def run():
        async with async_client(server.url, 300) as c:
            tasks = [asyncio.ensure_future(stream(c, p, b, None, 300)) for p, b in plan]
            g = await wait_gauges(c, lambda g: g.running == running and g.waiting == n - running, 120)
            assert (g.running, g.waiting) == (running, n - running), f"not all admitted: {g}"
            pids = descendants(server.pid)
            t0 = time.monotonic()
            server.signal(signal.SIGTERM)
            return pids, t0, await asyncio.gather(*tasks)

    pids, t0, results = asyncio.run(run())
    code = server.wait(60)
    exited = time.monotonic() - t0
    left = wait_gone(pids, 60)
    bad = [
        r
        for r in results
        if not (r.status == 200 and r.done and r.error is None and r.finish_reasons[-1:] == ["abort"])
    ]
    slowest = max(r.ended_at for r in results) - t0
    figures.append(
        f"SIGTERM: {n} open streams ({running} running, {n - running} waiting) all ended in {slowest:.2f} s; "
        f"exit code {code} after {exited:.1f} s; {len(left)} processes left"
    )
    assert not bad, f"{len(bad)} streams did not end with abort + [DONE]:\n" + "\n".join(map(str, bad[:10]))
    assert code == 0, f"exit code {code}:\n{server.log()[-3000:]}"
    assert not left, f"left behind: {left}"
