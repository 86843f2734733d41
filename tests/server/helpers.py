"""Helpers the server tests import: the test server's name and key, a uvicorn server on a
thread, Prometheus scraping, process checks (Linux /proc), a thread-mode AsyncLLM run in
lockstep with its consumers. Fixtures live in conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

API_KEY = "sk-test-key"
MODEL_NAME = "test-model"
# ChatML, for tokenizers that ship without a chat template
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def pick_model(tiny_models) -> str:
    """The bundled model when its weights are there, else the tiny random qwen3."""
    import pagedllm

    default = pagedllm.default_model_path()
    if os.path.isfile(os.path.join(default, "model.safetensors")):
        return default
    return tiny_models["qwen3"]


class LiveServer:
    """uvicorn.Server on 127.0.0.1, port 0, in a daemon thread, configured as `pagedllm serve`
    configures it (launcher.uvicorn_config; `config` overrides, e.g. timeout_keep_alive);
    `base_url` once started."""

    def __init__(self, app, make_server=None, **config):
        import uvicorn

        from pagedllm.entrypoints.openai.launcher import uvicorn_config

        make_server = make_server or uvicorn.Server  # e.g. launcher.AbortingServer with its arguments
        self.server = make_server(
            uvicorn_config(app, **{"host": "127.0.0.1", "port": 0, "log_level": "warning", **config})
        )
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 120  # a bound for a hang, not a speed: the box may be busy
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def scrape(url: str) -> list[tuple[str, dict, float]]:
    """GET /metrics -> [(name, labels, value)]."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def fresh_scrape(url: str, async_llm: Any, timeout: float = 120.0) -> list[tuple[str, dict, float]]:
    """scrape(url) once the engine core's metrics in the API process (AsyncLLM.stats) arrived
    after this call: they then count everything that happened in the core before the last
    answer the caller got (the pipe keeps order; the core sends them with its steps at most every
    20 ms and when it goes idle, so a plain scrape may be a step or more behind). An idle core
    sends them again on any message: an empty Abort."""
    from pagedllm.engine.messages import Abort

    since = time.monotonic()
    async_llm.core.send(Abort([]))
    deadline = since + timeout  # a bound for a hang, not a speed
    while async_llm.stats.time <= since:
        assert time.monotonic() < deadline, "the engine core's metrics never came"
        time.sleep(0.01)
    return scrape(url)


def metric(samples: list[tuple[str, dict, float]], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def pid_alive(pid: int) -> bool:
    """Is a process with this pid running (and not a zombie)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def child_pids(pid: int) -> list[int]:
    """The live children of a process (from /proc; Linux)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(d))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(args: list[str], log, env: dict | None = None, timeout: float = 300) -> subprocess.Popen:
    """`python -m pagedllm serve ARGS --port P` (P free), its output to the file `log`; returns
    once /health answers 200, with `.url` set."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm", "serve", *args, "--port", str(port)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            p.wait()
            log.seek(0)
            raise RuntimeError("server did not start:\n" + log.read())
        time.sleep(0.1)
    p.url = url  # type: ignore[attr-defined]
    return p


def engine_core_pid(server_pid: int) -> int:
    """The engine core among a server's children (named pagedllm-core: entrypoints/proc_name.py;
    the API processes of --api-server-count and multiprocessing's resource tracker are others)."""
    for pid in child_pids(server_pid):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "pagedllm-core":
                    return pid
        except OSError:
            continue
    raise LookupError(f"process {server_pid} has no engine core child")


@contextlib.contextmanager
def lockstep(async_llm: Any, timeout: float = 120.0) -> Iterator[None]:
    """Run a thread-mode AsyncLLM (`AsyncLLM(llm=...)`, `engine_process=False`) in lockstep with
    its consumers: the core takes a step only once the previous step's outputs have been applied
    on the event loop and every streamed output they made due has been taken by its consumer. So
    each output holds what became due at one step, whatever the scheduling, as if the consumer
    always kept up (a late consumer otherwise gets one merged output: streams.py). `timeout`:
    how long the core waits for a consumer before its step fails (a hung test, not a speed)."""
    core, registry = async_llm.llm.engine.core, async_llm.registry
    real_step, real_apply = core.step, registry.apply
    go = threading.Semaphore(1)  # the core may take one step
    stopped = False

    def step() -> list:
        if not stopped and not go.acquire(timeout=timeout):
            raise TimeoutError(f"lockstep: a step's outputs were not taken within {timeout:.0f} s")
        outputs = real_step()
        if not outputs:
            go.release()  # no outputs come back for this step: nothing to wait for
        return outputs

    def apply(outputs: list) -> None:
        real_apply(outputs)
        if not outputs:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # read by shutdown's drain: no consumer to wait for
            go.release()
            return

        def release_once_taken() -> None:
            # a consumer woken by apply runs before this callback (asyncio runs callbacks in order);
            # one that hands outputs on through more tasks (serving's _merged) may need more turns
            if any(h.state.stream and registry.ready(h) for h in list(registry.by_core_id.values())):
                loop.call_soon(release_once_taken)
            else:
                go.release()

        loop.call_soon(release_once_taken)

    core.step, registry.apply = step, apply
    try:
        yield
    finally:
        stopped = True
        core.step, registry.apply = real_step, real_apply
        go.release()  # a core waiting in step() goes on
