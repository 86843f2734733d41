"""`--launch`: a `pagedllm serve` child process on a free local port, for one benchmark run.

The child is this interpreter's `-m pagedllm serve`, so it runs the same pagedllm as the
benchmark. It is healthy once GET /health answers 200; it is stopped with SIGTERM (the server's
graceful shutdown), then killed if it has not exited within 60 s.
"""

from __future__ import annotations

import shlex
import signal
import socket
import subprocess
import sys
import time

from pagedllm import envs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(
    model: str, server_args: str, timeout: float, api_key: str | None
) -> tuple[subprocess.Popen[bytes], str]:
    """Start `pagedllm serve --model MODEL SERVER_ARGS`; returns it and its base URL once healthy.

    `api_key` reaches the child as PAGEDLLM_API_KEY (not as a flag: the command line is printed).
    """
    import httpx

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "pagedllm",
        "serve",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *shlex.split(server_args),
    ]
    print("launching: " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=envs.child_environ(api_key=api_key))  # the key not on the command line
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before becoming healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server was not healthy after {timeout:.0f} s")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_model_name(base_url: str, api_key: str | None) -> str:
    """The first model id the server lists at /v1/models."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()
    return data["data"][0]["id"]
