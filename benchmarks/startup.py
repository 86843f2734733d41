"""Start-up time (issue 29): seconds from a fresh Python process to a ready `LLM(...)`, with
`LLM.startup_seconds` (each phase of pagedllm/engine/startup_times.py), and to a healthy
`pagedllm serve` (GET /health answers 200). Each run is a new process, so imports count; the
Triton cache is whatever the machine has (run twice: the first run fills it).

    python benchmarks/startup.py --model DIR [--runs 2] [--serve] [--out FILE] [-- ENGINE FLAGS...]

ENGINE FLAGS are `pagedllm serve`'s (e.g. --kv-cache-dtype fp8); the LLM runs take the same ones
as keyword arguments. One JSON row per run is printed and appended to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LLM_SCRIPT = """
import json, sys, time
t0 = time.perf_counter()
from pagedllm import LLM
imported = time.perf_counter() - t0
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
print("STARTUP " + json.dumps(dict(import_pagedllm=imported, **llm.startup_seconds)))
"""


def flags_to_kwargs(flags: list[str]) -> dict:
    """['--kv-cache-dtype', 'fp8', '--enforce-eager'] -> {'kv_cache_dtype': 'fp8', 'enforce_eager': True}."""
    kw: dict = {}
    i = 0
    while i < len(flags):
        name = flags[i].lstrip("-").replace("-", "_")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value: object = flags[i + 1]
            try:
                value = json.loads(flags[i + 1])
            except ValueError:
                pass
            kw[name] = value
            i += 2
        else:
            kw[name] = True
            i += 1
    return kw


def llm_run(model: str, flags: list[str]) -> dict:
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-c", LLM_SCRIPT, model, json.dumps(flags_to_kwargs(flags))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    wall = time.perf_counter() - t0
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("STARTUP ")), None)
    if line is None:
        raise RuntimeError(f"LLM start-up failed:\n{res.stderr[-3000:]}")
    phases = json.loads(line[len("STARTUP ") :])
    return dict(what="LLM", process_to_ready_s=round(wall, 3), phases={k: round(v, 3) for k, v in phases.items()})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_run(model: str, flags: list[str], timeout: float = 300.0) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--port", str(port), *flags]
    log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: nobody reads it while the server runs
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"pagedllm serve exited {proc.returncode}:\n{log.read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError("pagedllm serve did not become healthy")
            time.sleep(0.05)
        healthy = time.perf_counter() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return dict(what="serve", process_to_healthy_s=round(healthy, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--serve", action="store_true", help="also time `pagedllm serve` to a healthy /health")
    ap.add_argument("--out", default=None)
    ap.add_argument("flags", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    flags = [f for f in a.flags if f != "--"]
    sys.path.insert(0, ROOT)
    from pagedllm.bench.common import environment

    env = environment()
    env["variant"] = os.environ.get("STARTUP_VARIANT", "")  # what else this run's set-up changes (gpu_check.sh)
    env["bytecode_cache"] = os.environ.get("PYTHONPYCACHEPREFIX") or "beside the sources"
    model = os.path.basename(a.model.rstrip("/"))
    runs = [llm_run] * a.runs + ([serve_run] * a.runs if a.serve else [])
    for i, fn in enumerate(runs):
        try:
            row = dict(fn(a.model, flags), run=i % a.runs, flags=flags, model=model)
        except RuntimeError as e:  # recorded, and the other runs still go
            row = dict(what=fn.__name__, error=str(e)[-2000:], run=i % a.runs, flags=flags, model=model)
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(dict(row, **env)) + "\n")


if __name__ == "__main__":
    main()
