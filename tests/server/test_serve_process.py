"""`python -m pagedllm serve` as a subprocess: a busy port refused in one line before the model
loads; the API key from the environment, a foreign Host refused (bound to loopback) unless
--allowed-hosts names it, --max-request-body-size, 429 when the queue is full, and SIGTERM with a stream open (the stream ends cleanly, the process exits
0, its engine core process is gone)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.server.helpers import ROOT, child_pids, metric, pid_alive, scrape, start_serve

KEY = "sk-from-env"


# two API processes: the slow job (.ci/run runs it after the README command); the README command keeps
# N = 1 here and tests/server/test_api_server_count.py for two API sides over one core
@pytest.fixture(
    scope="module",
    params=[pytest.param(1, id="api-servers-1"), pytest.param(2, id="api-servers-2", marks=pytest.mark.slow)],
)
def proc_server(long_context_model, tmp_path_factory, request):
    """`pagedllm serve` with one API process, and with two over one engine core (--api-server-count):
    every check below holds for the whole server either way (the queue is counted over both)."""
    env = dict(os.environ, PAGEDLLM_API_KEY=KEY)
    args = ["--model", long_context_model, "--device", "cpu", "--num-kv-blocks", "2100", "--max-num-seqs", "1"]
    args += ["--api-server-count", str(request.param)]
    args += ["--kv-cache-dtype", "fp8"]  # the server's path to an fp8 cache (the checks below do not depend on it)
    args += ["--max-queue-len", "1", "--served-model-name", "tiny", "--log-level", "warning"]
    args += ["--allowed-hosts", "gpu-box.lan", "--max-request-body-size", "1MiB"]
    log = open(tmp_path_factory.mktemp("serve_log") / "server.log", "w+")
    p = start_serve(args, log, env)
    yield p
    if p.poll() is None:
        p.kill()
        p.wait()
    log.close()


def test_a_busy_port_is_one_line_and_exit_1_before_the_model_loads(tiny_models):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "pagedllm", "serve", "--model", tiny_models["qwen3"], "--device", "cpu"]
        r = subprocess.run([*cmd, "--port", str(port)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines() == [
        f"pagedllm: error: port {port} on 127.0.0.1 is already in use (pick another with --port)"
    ]  # nothing else: no engine core was started, no model loaded
    assert r.stdout == ""


def test_key_from_env_queue_full_and_sigterm_with_an_open_stream(proc_server):
    url = proc_server.url
    scraped = scrape(url)
    info = [lab for name, lab, _ in scraped if name == "pagedllm:cache_config_info"]
    assert info and info[0]["kv_cache_dtype"] == "fp8_e4m3" and info[0]["num_gpu_blocks"] == "2100"
    groups = [(lab["group"], lab["kind"], v) for name, lab, v in scraped if name == "pagedllm:kv_cache_group_blocks"]
    assert groups == [("0", "full_attention", 0.0)]  # one group of every layer, idle
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=60).status_code == 401
    # bound to 127.0.0.1: a page that rebinds its own name to it is refused (DNS rebinding)
    foreign = httpx.get(url + "/health", headers={"Host": "evil.example:8000"}, timeout=60)
    assert foreign.status_code == 421 and foreign.json()["error"]["code"] == "invalid_host"
    assert httpx.get(url + "/health", headers={"Host": "localhost:8000"}, timeout=60).status_code == 200
    assert (
        httpx.get(url + "/health", headers={"Host": "gpu-box.lan:8000"}, timeout=60).status_code == 200
    )  # --allowed-hosts
    big = httpx.post(
        url + "/v1/completions",
        json={"prompt": "x" * (1 << 20)},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    long = dict(
        model="tiny", prompt="def f(x):", max_tokens=30000, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    a = client.completions.create(**long)  # runs (max_num_seqs=1) for a long time
    first = next(iter(a))
    assert first.choices[0].finish_reason is None

    b_chunks: list = []

    def consume_b():
        for chunk in client.completions.create(**long):
            b_chunks.append(chunk)

    b = threading.Thread(target=consume_b, daemon=True)
    b.start()  # waits: the only sequence slot is A's
    deadline = time.monotonic() + 120  # bounds for a hang, not speeds: the box may be busy
    while metric(scrape(url), "pagedllm:num_requests_waiting") != 1:
        assert time.monotonic() < deadline, "the second request never showed up as waiting"
        time.sleep(0.02)
    with pytest.raises(openai.RateLimitError) as e:  # the queue (length 1) is full
        client.completions.create(model="tiny", prompt="x", max_tokens=1)
    assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"

    children = child_pids(proc_server.pid)  # the engine core (and multiprocessing's helper)
    assert children
    proc_server.send_signal(signal.SIGTERM)
    rest = list(a)  # the open stream ends cleanly ([DONE])
    assert rest and rest[-1].choices[0].finish_reason == "abort"
    assert all(c.choices[0].finish_reason is None for c in rest[:-1])
    b.join(60)
    assert not b.is_alive() and b_chunks and b_chunks[-1].choices[0].finish_reason == "abort"
    assert proc_server.wait(60) == 0
    deadline = time.monotonic() + 60
    while any(pid_alive(p) for p in children):
        assert time.monotonic() < deadline, f"left behind: {[p for p in children if pid_alive(p)]}"
        time.sleep(0.05)
