"""Serving benchmark: load an OpenAI-compatible server the way users do, and time it.

N requests of `--input-len` random token ids (sent as a token-id `prompt` to /v1/completions,
so the server sees exactly that many tokens) and `--output-len` tokens each (`ignore_eos`),
streamed over SSE. Arrivals are Poisson at `--request-rate` (inf: all at once). Reported as
vLLM's `bench serve` does: request throughput, output tok/s, and TTFT / TPOT / ITL mean,
median and p99, where

  TTFT = time to the first chunk with a token, TPOT = (latency - TTFT) / (output tokens - 1)
  per request, ITL = every gap between two chunks of a request.

The load generator is plain asyncio + httpx (not the openai client, whose per-chunk overhead
would be measured too), spread over several processes on a machine with many cores: one
asyncio + httpx process spends ~50 us of CPU per SSE event (measured on CPU), so alone it
would saturate near the 15k events/s of 120 req/s x 128 tokens. `--launch` starts
`pagedllm serve` itself and stops it afterwards; otherwise `--base-url` names a running
server. Each run appends a JSON row to benchmarks/results/<gpu>.json (or --result-name).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0


def add_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("target")
    g.add_argument(
        "--base-url",
        default=None,
        help="server to load, e.g. http://127.0.0.1:8000 (default: that, or the --launch'ed one)",
    )
    g.add_argument(
        "--launch",
        action="store_true",
        help="start `pagedllm serve --model MODEL SERVER_ARGS` on a free port, stop it at the end",
    )
    g.add_argument(
        "--model",
        default=None,
        help="model directory: served with --launch, and its tokenizer draws the random prompts "
        "(default: the bundled model's tokenizer)",
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer directory for the random prompts (default: --model)")
    g.add_argument(
        "--server-args",
        default="",
        metavar="ARGS",
        help='extra flags for the launched server, e.g. "--device cuda --max-num-seqs 512"',
    )
    g.add_argument(
        "--launch-timeout",
        type=float,
        default=900.0,
        metavar="SECONDS",
        help="how long the launched server may take to become healthy",
    )
    g.add_argument("--api-key", default=None, help="bearer key (default: $PAGEDLLM_API_KEY)")
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the 'model' field to send (default: the first model the server lists)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=500, help="number of requests")
    w.add_argument("--input-len", type=int, default=512, help="prompt tokens per request (random token ids)")
    w.add_argument("--output-len", type=int, default=128, help="output tokens per request (ignore_eos)")
    w.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrival rate in requests/s; inf sends everything at once",
    )
    w.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the prompts and of the arrival times; a second run with the same seed against "
        "the same server hits its prefix cache, so change it or restart the server",
    )
    w.add_argument("--warmup-requests", type=int, default=2, help="short requests sent (and not timed) before the run")
    w.add_argument(
        "--client-processes",
        type=int,
        default=0,
        metavar="N",
        help="load-generator processes (request i goes to process i %% N, all start together); "
        "0: min(4, CPUs / 4, prompts / 64), at least 1",
    )
    o = p.add_argument_group("output")
    o.add_argument("--results-dir", default="benchmarks/results")
    o.add_argument("--result-name", default=None, help="results file name without .json (default: the GPU)")
    o.add_argument("--label", default="", help="free text stored with the row")
    o.add_argument("--no-save", action="store_true", help="print only; append no row")
    return p


# ---- the workload ----------------------------------------------------------------------------
def random_prompts(tokenizer_dir: str, num: int, length: int, seed: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    rng = random.Random(seed)
    return [rng.choices(vocab, k=length) for _ in range(num)]


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Start time of each request (s from the start): Poisson process at `rate`, or all at 0."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def one_request(client, url: str, headers: dict, payload: dict) -> RequestResult:
    res = RequestResult(prompt_len=len(payload["prompt"]))
    start = time.monotonic()  # one clock for every client process of the host
    res.start = start
    last = start
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                now = time.monotonic()
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])
                    return res
                if obj.get("choices"):
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if obj.get("usage"):
                    res.output_tokens = obj["usage"]["completion_tokens"]
        res.latency = time.monotonic() - start
        res.ok = res.ttft > 0
        if not res.ok:
            res.error = "no tokens streamed"
    except Exception as e:  # noqa: BLE001  (counted as a failed request)
        res.error = f"{type(e).__name__}: {e}"
    return res


@dataclass
class _Load:
    """What a client process needs (picklable)."""

    url: str
    headers: dict
    model: str
    temperature: float
    output_len: int
    max_concurrency: int | None

    def payload(self, prompt: list[int], max_tokens: int) -> dict:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }


def _client():
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits, http2=False)


async def _drive(load: _Load, items: list[tuple[list[int], float]], t0: float) -> tuple[list[RequestResult], float]:
    """Send each prompt at t0 + its offset (time.monotonic()); returns the results and the end time."""
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    async with _client() as client:

        async def scheduled(prompt: list[int], at: float) -> RequestResult:
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                return await one_request(client, load.url, load.headers, load.payload(prompt, load.output_len))
            async with sem:
                return await one_request(client, load.url, load.headers, load.payload(prompt, load.output_len))

        results = await asyncio.gather(*(scheduled(p, at) for p, at in items))
    return list(results), time.monotonic()


def _client_process(conn, load: _Load, items: list) -> None:
    """A spawned load-generator process: report ready, wait for the common start time, run."""
    conn.send("ready")
    t0 = conn.recv()
    conn.send(asyncio.run(_drive(load, items, t0)))
    conn.close()


def client_process_count(requested: int, num_prompts: int) -> int:
    if requested > 0:
        return min(requested, num_prompts)
    return max(1, min(4, (os.cpu_count() or 1) // 4, num_prompts // 64))


def run_load(base_url: str, model: str, prompts: list[list[int]], args) -> tuple[list[RequestResult], float]:
    """Warm up, then run the whole load, spread over `--client-processes` processes."""
    load = _Load(
        base_url.rstrip("/") + "/v1/completions",
        {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {},
        model,
        args.temperature,
        args.output_len,
        args.max_concurrency,
    )

    async def warmup() -> None:
        async with _client() as client:
            for i in range(args.warmup_requests):
                r = await one_request(client, load.url, load.headers, load.payload(prompts[i % len(prompts)][:16], 4))
                if not r.ok:
                    raise RuntimeError(f"warm-up request failed: {r.error}")

    asyncio.run(warmup())
    offsets = arrival_offsets(len(prompts), args.request_rate, args.seed)
    n = client_process_count(getattr(args, "client_processes", 1), len(prompts))
    if n == 1:
        t0 = time.monotonic()
        results, end = asyncio.run(_drive(load, list(zip(prompts, offsets, strict=False)), t0))
        return results, end - t0
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    if load.max_concurrency:
        load.max_concurrency = -(-load.max_concurrency // n)  # the cap is shared out evenly
    conns, procs = [], []
    try:
        for i in range(n):  # request i goes to process i % n: each gets the same mix
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_client_process,
                args=(child, load, list(zip(prompts[i::n], offsets[i::n], strict=False))),
                name=f"bench-client-{i}",
                daemon=True,
            )
            p.start()
            child.close()
            conns.append(parent)
            procs.append(p)
        for c in conns:
            if c.recv() != "ready":
                raise RuntimeError("a load-generator process failed to start")
        t0 = time.monotonic() + 0.05
        for c in conns:
            c.send(t0)
        parts = [c.recv() for c in conns]
    except EOFError:
        raise RuntimeError("a load-generator process died") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    merged: list[RequestResult] = [RequestResult() for _ in prompts]
    for i, (part, _) in enumerate(parts):
        merged[i::n] = part
    return merged, max(end for _, end in parts) - t0


# ---- statistics ------------------------------------------------------------------------------
def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ttft = [r.ttft * 1000 for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok if r.output_tokens > 1]
    itl = [x * 1000 for r in ok for x in r.itl]
    e2e = [r.latency * 1000 for r in ok]
    s: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": round(duration, 3),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": round(len(ok) / duration, 3) if duration else 0.0,
        "output_throughput": round(out_tokens / duration, 1) if duration else 0.0,
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 1) if duration else 0.0,
    }
    for name, xs in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2el_ms", e2e)):
        s[f"mean_{name}"] = round(statistics.fmean(xs), 3) if xs else 0.0
        s[f"median_{name}"] = round(statistics.median(xs), 3) if xs else 0.0
        s[f"p99_{name}"] = round(_percentile(xs, 99), 3)
    errors = [r.error for r in results if not r.ok]
    if errors:
        s["first_error"] = errors[0]
    return s


def format_table(s: dict) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label, value):
        lines.append(f"{label:<36}{value:>14}")

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", f"{s['duration_s']:.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{s['output_throughput']:.1f}")
    row("Total token throughput (tok/s):", f"{s['total_token_throughput']:.1f}")
    for title, key in (
        ("Time to First Token", "ttft_ms"),
        ("Time per Output Token (excl. 1st token)", "tpot_ms"),
        ("Inter-token Latency", "itl_ms"),
        ("End-to-end Latency", "e2el_ms"),
    ):
        lines.append("{s:{c}^50}".format(s=f" {title} ", c="-"))
        short = key.split("_")[0].upper()
        for stat in ("mean", "median", "p99"):
            row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {short} (ms):", f"{s[f'{stat}_{key}']:.2f}")
    lines.append("=" * 50)
    if s.get("first_error"):
        lines.append(f"first error: {s['first_error']}")
    return "\n".join(lines)


# ---- the launched server -----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(model: str, server_args: str, timeout: float, api_key: str | None):
    import httpx

    port = _free_port()
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
    env = dict(os.environ)
    if api_key:
        env["PAGEDLLM_API_KEY"] = api_key
    proc = subprocess.Popen(cmd, env=env)
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


def stop_server(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_model_name(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()
    return data["data"][0]["id"]


def main(args: argparse.Namespace) -> int:
    from pagedllm import default_model_path, envs

    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (inf for all at once)")
    args.api_key = args.api_key or envs.api_key()
    if args.launch and not args.model:
        raise ValueError("--launch needs --model")
    tokenizer_dir = args.tokenizer or args.model or default_model_path()
    prompts = random_prompts(tokenizer_dir, args.num_prompts, args.input_len, args.seed)
    proc = None
    base_url = args.base_url or "http://127.0.0.1:8000"
    try:
        if args.launch:
            proc, base_url = launch_server(args.model, args.server_args, args.launch_timeout, args.api_key)
        model = args.served_model_name or server_model_name(base_url, args.api_key)
        results, duration = run_load(base_url, model, prompts, args)
    finally:
        if proc is not None:
            stop_server(proc)
    summary = summarize(results, duration)
    print(format_table(summary))
    config = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "temperature": args.temperature,
        "seed": args.seed,
        "model": os.path.basename(os.path.normpath(args.model)) if args.model else model,
        "launched": bool(args.launch),
        "server_args": args.server_args if args.launch else None,
        "client_processes": client_process_count(args.client_processes, args.num_prompts),
    }
    if not args.no_save:
        from pagedllm.bench.common import append_result, environment

        row = {"benchmark": "serving", "config": config, "results": summary, "label": args.label, **environment()}
        path = append_result(row, args.results_dir, args.result_name)
        print(f"appended to {path}", file=sys.stderr)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    sys.exit(main(parser.parse_args()))
