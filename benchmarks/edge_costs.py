"""What the hardening of the serving edge costs, on CPU: the numbers the README quotes.

    python benchmarks/edge_costs.py hashing        # prefix-cache admissions, xxhash vs sha256
    python benchmarks/edge_costs.py json           # parsing.json_body against json.loads alone
    python benchmarks/edge_costs.py health [--tree OLD_CHECKOUT]
        # /health latency while one 6 MB prompt is tokenized, `pagedllm serve` on the bundled model

Each appends one row (commit, torch, CPU, date, load average) to benchmarks/results/edge-cpu.json.
`health --tree DIR` serves DIR's pagedllm (an older checkout) with the same client, so a
before/after pair is one script on one machine. The machine is this project's 2-core box,
shared: medians over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "edge-cpu.json")


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 2)


def hashing(repeats: int) -> dict:
    """300 admissions of distinct 1,024-token prompts (block 16: 64 hashed blocks each), freed after."""
    import random

    from pagedllm.engine import KVCacheManager, SamplingParams, Sequence

    rng = random.Random(0)
    prompts = [[rng.randrange(50_000) for _ in range(1024)] for _ in range(300)]

    def admit_all(algo: str) -> None:
        kv = KVCacheManager(300 * 65, 16, hash_algo=algo)
        seqs = []
        for p in prompts:
            s = Sequence("r", p, SamplingParams())
            hit = kv.get_computed_blocks(s)
            assert kv.allocate_slots(s, s.num_tokens - len(hit) * 16, hit)
            s.num_computed_tokens = s.num_written = s.num_tokens
            kv.cache_full_blocks(s)
            seqs.append(s)
        for s in seqs:
            kv.free(s)

    return {algo: median_ms(lambda a=algo: admit_all(a), repeats) for algo in ("xxhash", "sha256")}


def json_costs(repeats: int) -> dict:
    from pagedllm.entrypoints.openai.parsing import json_body

    bodies = {
        "6 MB ASCII prompt": {"model": "m", "prompt": "def f(x):\n    return x\n" * 262_144},
        "1M token ids": {"model": "m", "prompt": list(range(1_000_000))},
        "100-message chat": {"model": "m", "messages": [{"role": "user", "content": "hi " * 50}] * 100},
    }
    out = {}
    for name, body in bodies.items():
        raw = json.dumps(body).encode()
        out[name] = {
            "json_body_ms": median_ms(lambda r=raw: json_body(r), repeats),
            "json_loads_ms": median_ms(lambda r=raw: json.loads(r), repeats),
        }
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(tree: str) -> dict:
    """Serve the bundled model from `tree`; while one 6 MB prompt is processed (it is refused as
    too long after tokenizing), poll /health and record how long each answer took."""
    import httpx

    port = free_port()
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pagedllm", "serve", "--device", "cpu", "--port", str(port)]
    cmd += ["--served-model-name", "m", "--log-level", "warning", "--disable-uvicorn-access-log"]
    p = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        body = json.dumps({"model": "m", "prompt": "def f(x):\n    return x\n" * 262_144, "max_tokens": 1})
        big: dict = {}

        def send() -> None:
            t0 = time.monotonic()
            r = httpx.post(
                url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=600
            )
            big.update(status=r.status_code, seconds=round(time.monotonic() - t0, 2))

        t = threading.Thread(target=send)
        t.start()
        time.sleep(0.5)  # the body is sent and being processed
        lat = []
        with httpx.Client(timeout=600) as c:
            while t.is_alive():
                t0 = time.monotonic()
                c.get(url + "/health")
                lat.append(time.monotonic() - t0)
                time.sleep(0.01)
        t.join()
        return {
            "big_request": big,
            "health_answers": len(lat),
            "health_median_ms": round(statistics.median(lat) * 1e3, 1),
            "health_max_s": round(max(lat), 2),
        }
    finally:
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def commit_of(tree: str) -> str:
    r = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"], capture_output=True)
    return (r.stdout.strip() or "unknown") + ("-dirty" if dirty.stdout.strip() else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("hashing", "json", "health"))
    ap.add_argument("--tree", default=ROOT, help="health: the checkout to serve (default: this one)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    import torch

    if args.what == "hashing":
        result = hashing(args.repeats)
    elif args.what == "json":
        result = json_costs(args.repeats)
    else:
        result = health(os.path.abspath(args.tree))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    row = {
        "benchmark": f"edge_costs {args.what}",
        "result": result,
        "commit": commit_of(args.tree if args.what == "health" else ROOT),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    print(json.dumps(row, indent=1))
    rows = json.load(open(RESULTS)) if os.path.exists(RESULTS) else []
    rows.append(row)
    with open(RESULTS, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
