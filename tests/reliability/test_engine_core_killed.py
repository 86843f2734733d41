"""The engine core process killed (SIGKILL) under load, in a `pagedllm serve` process: every
open stream ends with an `engine_dead` error event and [DONE] (not a hang), every waiting
non-streamed request gets a 503 `engine_dead`. Then, by default, the API server exits with a
non-zero code (so that a supervisor restarts it), leaving no process behind; with
--keep-alive-on-engine-death it stays up answering 503 until SIGTERM, then exits 0.
(tests/server/test_engine_death.py covers one stream, the 503s for new requests and /health,
in-process.) The keep-alive variant costs one more server process, so it runs under --soak."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import httpx
import pytest

from tests.reliability.helpers import (
    ServeProcess,
    async_client,
    chat_body,
    completion_body,
    descendants,
    stream,
    wait_gauges,
    wait_gone,
)

KEEP_ALIVE_FLAG = "--keep-alive-on-engine-death"
NON_STREAMED = 4
REQUEST_BOUND_S = 300.0  # each request's client timeout: a bound for a hang, not a speed
EXIT_BOUND_S = 60.0  # from the kill to the API server's exit (a bound for a hang)


def _server(model: str, tmp_path_factory, *extra: str):
    log = tmp_path_factory.mktemp("engine_core_killed") / "server.log"
    srv = ServeProcess(model, str(log), 4096, 256, *extra)
    try:
        yield srv.start()
    finally:
        srv.stop()


# two API processes: the slow job (.ci/run runs it after the README command); the README command keeps
# N = 1 here and tests/server/test_api_server_count.py for two API sides over one core
@pytest.fixture(
    scope="module",
    params=[pytest.param(1, id="api-servers-1"), pytest.param(2, id="api-servers-2", marks=pytest.mark.slow)],
)
def server(reliability_model, tmp_path_factory, request):
    """One API process, and two over one engine core: every one of them must end its streams."""
    yield from _server(reliability_model, tmp_path_factory, "--api-server-count", str(request.param))


@pytest.fixture(scope="module")
def keep_alive_server(reliability_model, tmp_path_factory, sizes):
    if not sizes.soak:
        pytest.skip("one more server process: runs under --soak")
    yield from _server(reliability_model, tmp_path_factory, KEEP_ALIVE_FLAG)


@dataclasses.dataclass
class Killed:
    t0: float  # when the core was killed (time.monotonic())
    pids: list[int]  # every process below the server just before
    problems: list[str]  # streams or requests that did not end as they must
    streams_ended_s: float
    posts_ended_s: float


def kill_core_under_load(server: ServeProcess, n: int) -> Killed:
    """n streams (both endpoints) and NON_STREAMED plain requests, all running, then SIGKILL to
    the core. Each stream must end with an engine_dead event and [DONE], each plain request with
    a 503 engine_dead (their 2,000 tokens take far longer than the kill: a request that did not
    notice it would hang until its client's timeout)."""
    plan = [
        ("/v1/chat/completions", chat_body(i, 2000)) if i % 2 else ("/v1/completions", completion_body(i, 2000))
        for i in range(n)
    ]

    async def post(c: httpx.AsyncClient, i: int):
        try:
            r = await c.post(
                "/v1/completions", json=completion_body(n + i, 2000, stream=False), timeout=REQUEST_BOUND_S
            )
            return r.status_code, r.json(), time.monotonic()
        except (httpx.HTTPError, ValueError) as e:
            return None, repr(e), time.monotonic()

    async def run():
        async with async_client(server.url, REQUEST_BOUND_S) as c:
            tasks = [asyncio.ensure_future(stream(c, p, b, None, REQUEST_BOUND_S)) for p, b in plan]
            posts = [asyncio.ensure_future(post(c, i)) for i in range(NON_STREAMED)]
            total = n + NON_STREAMED
            g = await wait_gauges(c, lambda g: g.running == total, 120)
            assert g.running == total, f"not every request is running before the kill: {g}"
            await asyncio.sleep(0.2)  # tokens flowing on every stream
            core = server.core_pid()
            pids = descendants(server.pid)
            t0 = time.monotonic()
            os.kill(core, signal.SIGKILL)
            return pids, t0, await asyncio.gather(*tasks), await asyncio.gather(*posts)

    pids, t0, streams, posts = asyncio.run(run())
    problems = [
        f"stream: {r}"
        for r in streams
        if not (r.status == 200 and r.done and r.error is not None and r.error.get("code") == "engine_dead")
    ]
    problems += [
        f"non-streamed: {p}"
        for p in posts
        if not (p[0] == 503 and isinstance(p[1], dict) and p[1]["error"]["code"] == "engine_dead")
    ]
    return Killed(t0, pids, problems, max(r.ended_at for r in streams) - t0, max(p[2] for p in posts) - t0)


def test_engine_core_killed_under_load_the_server_exits_non_zero(server, sizes, figures):
    k = kill_core_under_load(server, sizes.kill_streams)
    code = server.wait(max(0.0, k.t0 + EXIT_BOUND_S - time.monotonic()))
    exited = time.monotonic() - k.t0
    left = wait_gone(k.pids, 60) if code is not None else k.pids  # a server still up keeps its processes
    figures.append(
        f"engine core killed: {sizes.kill_streams} streams + {NON_STREAMED} non-streamed requests in flight ended "
        f"in {k.streams_ended_s:.2f} s / {k.posts_ended_s:.2f} s; "
        + (f"server exit code {code} after {exited:.1f} s" if code is not None else f"server up after {exited:.0f} s")
    )
    assert not k.problems, f"{len(k.problems)} requests did not end as they must:\n" + "\n".join(k.problems[:10])
    assert code is not None, (
        f"the API server kept serving {EXIT_BOUND_S:.0f} s after its engine core died; by default it must exit "
        f"non-zero so that a supervisor restarts it\n{server.log()[-2000:]}"
    )
    assert code == 1, f"exit code {code} after the engine core died: 1 (a run-time failure) so a supervisor restarts it"
    last = server.log().strip().splitlines()[-1]
    assert last == (
        "pagedllm: error: the engine core process died (exit code -9): the server has stopped so that it can "
        "be restarted (--keep-alive-on-engine-death keeps it serving 503s instead)"
    ), last
    assert not left, f"left behind: {left}"


def test_keep_alive_on_engine_death_serves_503_until_sigterm(keep_alive_server, sizes, figures):
    server = keep_alive_server
    k = kill_core_under_load(server, sizes.kill_streams)
    assert not k.problems, f"{len(k.problems)} requests did not end as they must:\n" + "\n".join(k.problems[:10])
    assert server.wait(3) is None, f"the server exited although {KEEP_ALIVE_FLAG} was given"
    t0 = time.monotonic()
    assert httpx.get(server.url + "/health", timeout=60).status_code == 503
    r = httpx.post(server.url + "/v1/completions", json=completion_body(0, 4, stream=False), timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
    answered = time.monotonic() - t0
    server.signal(signal.SIGTERM)
    code = server.wait(60)
    left = wait_gone(k.pids, 60)
    figures.append(
        f"engine core killed ({KEEP_ALIVE_FLAG}): {sizes.kill_streams} streams ended in {k.streams_ended_s:.2f} s; "
        f"/health and a new request answered 503 in {answered:.2f} s; SIGTERM: exit code {code}"
    )
    assert code == 0, f"exit code {code} on SIGTERM after the engine died:\n{server.log()[-2000:]}"
    assert not left, f"left behind: {left}"
