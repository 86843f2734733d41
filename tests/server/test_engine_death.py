"""The engine core process dying. By default (`pagedllm serve`) open streams end with their
error event, then the server exits with code 1 and one error line, so that a supervisor
restarts it: tests/reliability/test_engine_core_killed.py checks that under load. With --keep-alive-on-engine-death (the server class the flag configures, in this
process): open streams end with an error event, waiting requests get 503, new requests get 503
at once, /health says 503, nothing hangs, and the server stays up. And the other way round: the
core never outlives the API process, even one killed with SIGKILL."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from pagedllm.entrypoints.async_llm import EngineShutdownError
from tests.server.helpers import (
    API_KEY,
    MODEL_NAME,
    ROOT,
    LiveServer,
    metric,
    pid_alive,
    scrape,
)

LONG = {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 30000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def doomed(long_context_model):
    """A server in keep-alive mode: what --keep-alive-on-engine-death makes of `pagedllm serve`."""
    from pagedllm.entrypoints.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.launcher import AbortingServer
    from pagedllm.entrypoints.openai.routes import build_app

    async_llm = AsyncLLM(long_context_model, device="cpu", num_kv_blocks=2100, max_num_seqs=4)
    app = build_app(async_llm, MODEL_NAME, API_KEY)
    srv = LiveServer(app, lambda config: AbortingServer(config, async_llm, exit_on_engine_death=False))
    srv.ticks = 0  # the server's main-loop ticks so far (on_tick, every 0.1 s)
    on_tick = srv.server.on_tick

    async def counted_tick(counter: int) -> bool:
        srv.ticks += 1
        return await on_tick(counter)

    srv.server.on_tick = counted_tick
    srv.start()
    srv.async_llm = async_llm
    yield srv
    srv.stop()
    async_llm.shutdown(10)


def test_with_keep_alive_the_core_dying_fails_in_flight_and_new_requests_promptly(doomed):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = doomed.url
    pid = doomed.async_llm.core_pid
    assert pid_alive(pid)
    non_streamed: dict = {}

    def post_non_streamed():
        r = httpx.post(url + "/v1/completions", json=LONG, headers=headers, timeout=60)
        non_streamed.update(status=r.status_code, body=r.json())

    waiter = threading.Thread(target=post_non_streamed, daemon=True)

    # Every wait below is a bound for a hang, not a speed (the box may be busy): a stream that does
    # not notice the death hangs until the client's read timeout; its 30,000 tokens take minutes.
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp:
            lines = (line for line in resp.iter_lines() if line)
            assert json.loads(next(lines)[6:])["choices"][0]["finish_reason"] is None
            waiter.start()
            deadline = time.monotonic() + 120
            while metric(scrape(url), "pagedllm:num_requests_running") != 2:
                assert time.monotonic() < deadline, "the non-streamed request never started"
                time.sleep(0.02)
            os.kill(pid, signal.SIGKILL)
            rest = list(lines)  # the stream ends: an error event, then [DONE]
    assert rest[-1] == "data: [DONE]"
    err = json.loads(rest[-2][6:])["error"]
    assert err["type"] == "service_unavailable" and "engine core process died" in err["message"]
    waiter.join(60)
    assert not waiter.is_alive() and non_streamed["status"] == 503
    assert non_streamed["body"]["error"]["code"] == "engine_dead"

    # new requests: 503 (not queued for an engine that is gone: they would hang), health 503,
    # metrics still served
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    assert e.value.status_code == 503 and e.value.body["code"] == "engine_dead"
    with pytest.raises(openai.InternalServerError):
        list(client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, stream=True))
    assert httpx.get(url + "/health", timeout=60).status_code == 503
    assert httpx.get(url + "/metrics", timeout=60).status_code == 200
    ticks = doomed.ticks
    deadline = time.monotonic() + 60
    while doomed.ticks < ticks + 3:  # several of the server's ticks (it checks the engine on each)
        assert time.monotonic() < deadline, "the server's main loop stopped ticking"
        time.sleep(0.05)
    assert doomed.thread.is_alive() and not doomed.server.should_exit  # it stays up
    assert httpx.get(url + "/health", timeout=60).status_code == 503

    async def add():
        doomed.async_llm.add_request("x")

    with pytest.raises(EngineShutdownError, match="died"):
        asyncio.run(add())
    # shutdown of a dead engine waits for nothing: with no timeout it would otherwise never return
    stopper = threading.Thread(target=doomed.async_llm.shutdown, args=(None,), daemon=True)
    stopper.start()
    stopper.join(60)
    assert not stopper.is_alive() and not pid_alive(pid)


CHILD = """
import sys, time
from pagedllm.entrypoints.async_llm import AsyncLLM
if __name__ == "__main__":
    a = AsyncLLM(sys.argv[1], device="cpu", num_kv_blocks=64)
    print(a.core_pid, flush=True)
    time.sleep(600)
"""


def test_the_core_exits_when_the_api_process_is_killed(tiny_models, tmp_path):
    # the model without its tokenizer: the API process then never imports transformers (and torch
    # with it), which would only slow this test's start; the core's lifetime does not depend on it
    model = tmp_path / "no_tokenizer"
    model.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_models["qwen3"], f), model / f)
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(model)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        core = int(p.stdout.readline())
        assert pid_alive(core)
        p.kill()  # SIGKILL: no atexit, no shutdown(); only the pipe's EOF
        p.wait(60)
        deadline = time.monotonic() + 60  # a bound for a hang, not a speed
        while pid_alive(core):
            assert time.monotonic() < deadline, "the engine core outlived its API process"
            time.sleep(0.05)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
