"""The engine core process killed (SIGKILL) under load, in a `pagedllm serve` process: every
open stream ends with an `engine_dead` error event and [DONE] within seconds, every waiting
non-streamed request gets a 503 `engine_dead`, and by default the API server then exits with
a non-zero code (so that a supervisor restarts it), leaving no process behind.
(tests/server/test_engine_death.py covers one stream, the 503s for new requests and /health,
in-process.)"""

from __future__ import annotations

import asyncio
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

NON_STREAMED = 4
STREAM_END_BOUND_S = 5.0  # from the kill to the last stream's error event
EXIT_BOUND_S = 15.0  # from the kill to the API server's exit


@pytest.fixture(scope="module")
def server(reliability_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("engine_core_killed") / "server.log"
    srv = ServeProcess(reliability_model, str(log), 4096, 256)
    yield srv.start()
    srv.stop()


def test_engine_core_killed_under_load(server, sizes, figures):
    n = sizes.kill_streams
    plan = [
        ("/v1/chat/completions", chat_body(i, 2000)) if i % 2 else ("/v1/completions", completion_body(i, 2000))
        for i in range(n)
    ]

    async def post(c: httpx.AsyncClient, i: int):
        try:
            r = await c.post("/v1/completions", json=completion_body(n + i, 2000, stream=False), timeout=30)
            return r.status_code, r.json(), time.monotonic()
        except (httpx.HTTPError, ValueError) as e:
            return None, repr(e), time.monotonic()

    async def run():
        async with async_client(server.url, 60) as c:
            tasks = [asyncio.ensure_future(stream(c, p, b, None, 30)) for p, b in plan]
            posts = [asyncio.ensure_future(post(c, i)) for i in range(NON_STREAMED)]
            total = n + NON_STREAMED
            g = await wait_gauges(c, lambda g: g.running == total, 60)
            assert g.running == total, f"not every request is running before the kill: {g}"
            await asyncio.sleep(0.2)  # tokens flowing on every stream
            core = server.core_pid()
            pids = descendants(server.pid)
            t0 = time.monotonic()
            os.kill(core, signal.SIGKILL)
            return pids, t0, await asyncio.gather(*tasks), await asyncio.gather(*posts)

    pids, t0, streams, posts = asyncio.run(run())
    code = server.wait(max(0.0, t0 + EXIT_BOUND_S - time.monotonic()))
    exited = time.monotonic() - t0
    left = wait_gone(pids, 10) if code is not None else pids  # a server still up keeps its processes

    bad_streams = [
        r
        for r in streams
        if not (r.status == 200 and r.done and r.error is not None and r.error.get("code") == "engine_dead")
    ]
    bad_posts = [p for p in posts if not (p[0] == 503 and p[1]["error"]["code"] == "engine_dead")]
    slowest = max(r.ended_at for r in streams) - t0
    slowest_post = max(p[2] for p in posts) - t0
    figures.append(
        f"engine core killed: {n} streams + {NON_STREAMED} non-streamed requests in flight; streams ended in "
        f"{slowest:.2f} s, non-streamed answered in {slowest_post:.2f} s; "
        + (
            f"server exit code {code} after {exited:.1f} s"
            if code is not None
            else f"server still up after {exited:.0f} s"
        )
    )
    assert not bad_streams, f"{len(bad_streams)} streams without an engine_dead event:\n" + "\n".join(
        map(str, bad_streams[:5])
    )
    assert not bad_posts, f"non-streamed requests: {bad_posts}"
    assert slowest < STREAM_END_BOUND_S and slowest_post < STREAM_END_BOUND_S
    assert code is not None, (
        f"the API server kept serving {EXIT_BOUND_S:.0f} s after its engine core died; by default it must exit "
        f"non-zero so that a supervisor restarts it\n{server.log()[-2000:]}"
    )
    assert code != 0, "the API server exited 0 after its engine core died (a supervisor would not see a failure)"
    assert not left, f"left behind: {left}"
