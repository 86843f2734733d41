"""Helpers the server tests import: the test server's name and key, a uvicorn server on a
thread, Prometheus scraping, process checks (Linux /proc). Fixtures live in conftest.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

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
        deadline = time.monotonic() + 30
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


def start_serve(args: list[str], log, env: dict | None = None, timeout: float = 60) -> subprocess.Popen:
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
    """The engine core among a server's children (multiprocessing's resource tracker is another)."""
    for pid in child_pids(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return pid
    raise LookupError(f"process {server_pid} has no engine core child")
