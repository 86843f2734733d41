"""The API process's CPU time per streamed token and per request (Linux: /proc), under the serving
benchmark's load.

All at once, the API process (HTTP, tokenizing, output processing, SSE) is one Python thread
that every token of every stream passes through: its CPU time per token bounds the requests per
second a server can stream, whatever the GPU does. This launches `pagedllm serve`, reads the
server process's CPU time (user + system; the engine core is another process) around one
`pagedllm bench serve` run, and prints and saves the ratio:

    python benchmarks/api_cpu.py [--model DIR] [--server-args "--device cuda"] [--num-prompts 200]
        [--input-len 256] [--output-len 64] [--request-rate inf] [--out FILE]

On a CPU-only machine the engine is slow, so the API process is mostly idle and every token is
its own SSE event (the worst case per token); on a GPU under full load a stream that falls behind
gets several tokens per event, so the per-token cost there is lower than this.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pagedllm.bench.common import environment  # noqa: E402
from pagedllm.bench.server_process import launch_server, stop_server  # noqa: E402

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pagedllm", "default_model")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--server-args", default="")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", default="inf")
    p.add_argument("--client-processes", type=int, default=0)
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None, help="append the result (JSON lines)")
    args = p.parse_args()
    proc, url = launch_server(args.model, args.server_args, 900.0, None)
    try:
        before, t0 = cpu_seconds(proc.pid), time.monotonic()
        bench = subprocess.run(
            [sys.executable, "-m", "pagedllm", "bench", "serve", "--base-url", url, "--model", args.model]
            + ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len)]
            + ["--output-len", str(args.output_len), "--request-rate", args.request_rate, "--seed", "1"]
            + ["--client-processes", str(args.client_processes), "--no-save"],
            capture_output=True,
            text=True,
        )
        cpu, wall = cpu_seconds(proc.pid) - before, time.monotonic() - t0
    finally:
        stop_server(proc)
    if bench.returncode != 0:
        sys.exit(f"the benchmark failed:\n{bench.stdout}\n{bench.stderr}")
    lines = [ln for ln in bench.stdout.splitlines() if "throughput" in ln or "TTFT" in ln or "TPOT" in ln]
    tokens = args.num_prompts * args.output_len  # the benchmark ignores EOS
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    try:
        import httptools  # noqa: F401

        http = "httptools"
    except ImportError:
        http = "h11"
    res = {
        "benchmark": "api_cpu",
        "label": args.label,
        "server_args": args.server_args,
        "loop": loop,
        "http": http,
        "python": sys.version.split()[0],
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": args.request_rate,
        "api_cpu_s": round(cpu, 3),
        "wall_s": round(wall, 2),
        "api_cpu_us_per_token": round(cpu / tokens * 1e6, 1),
        "api_cpu_ms_per_request": round(cpu / args.num_prompts * 1e3, 2),
        "bench": lines,
        **environment(),
    }
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
