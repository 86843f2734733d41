"""Serving benchmark: load an OpenAI-compatible server the way users do, and time it.

N requests of `--input-len` random token ids (sent as a token-id `prompt` to /v1/completions,
so the server sees exactly that many tokens) and `--output-len` tokens each (`ignore_eos`),
streamed over SSE. Arrivals are Poisson at `--request-rate` (inf: all at once). Reported as
vLLM's `bench serve` does: request throughput, output tok/s, and TTFT / TPOT / ITL mean,
median and p99, where

  TTFT = time to the first chunk with a token, TPOT = (latency - TTFT) / (output tokens - 1)
  per request, ITL = every gap between two chunks of a request.

The load generator is plain asyncio + httpx (not the openai client, whose per-chunk overhead
would be measured too). `--launch` starts `pagedllm serve` itself and stops it afterwards;
otherwise `--base-url` names a running server. Each run appends a JSON row to
benchmarks/results/<gpu>.json (or --result-name).
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
    g.add_argument("--base-url", default=None,
                   help="server to load, e.g. http://127.0.0.1:8000 (default: that, or the --launch'ed one)")
    g.add_argument("--launch", action="store_true",
                   help="start `pagedllm serve --model MODEL SERVER_ARGS` on a free port, stop it at the end")
    g.add_argument("--model", default=None,
                   help="model directory: served with --launch, and its tokenizer draws the random prompts "
                        "(default: the bundled model's tokenizer)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory for the random prompts (default: --model)")
    g.add_argument("--server-args", default="", metavar="ARGS",
                   help="extra flags for the launched server, e.g. \"--device cuda --max-num-seqs 512\"")
    g.add_argument("--launch-timeout", type=float, default=900.0, metavar="SECONDS",
                   help="how long the launched server may take to become healthy")
    g.add_argument("--api-key", default=None, help="bearer key (default: $PAGEDLLM_API_KEY)")
    g.add_argument("--served-model-name", default=None,
                   help="the 'model' field to send (default: the first model the server lists)")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=500, help="number of requests")
    w.add_argument("--input-len", type=int, default=512, help="prompt tokens per request (random token ids)")
    w.add_argument("--output-len", type=int, default=128, help="output tokens per request (ignore_eos)")
    w.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in requests/s; inf sends everything at once")
    w.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--seed", type=int, default=0,
                   help="seed of the prompts and of the arrival times; a second run with the same seed against "
                        "the same server hits its prefix cache, so change it or restart the server")
    w.add_argument("--warmup-requests", type=int, default=2,
                   help="short requests sent (and not timed) before the run")
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
    start = time.perf_counter()
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
                now = time.perf_counter()
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
        res.latency = time.perf_counter() - start
        res.ok = res.ttft > 0
        if not res.ok:
            res.error = "no tokens streamed"
    except Exception as e:                      # noqa: BLE001  (counted as a failed request)
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(base_url: str, model: str, prompts: list[list[int]], args) -> tuple[list[RequestResult], float]:
    import httpx
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    def payload(prompt: list[int], max_tokens: int) -> dict:
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": args.temperature,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits, http2=False) as client:
        for i in range(args.warmup_requests):
            r = await one_request(client, url, headers, payload(prompts[i % len(prompts)][:16], 4))
            if not r.ok:
                raise RuntimeError(f"warm-up request failed: {r.error}")
        offsets = arrival_offsets(len(prompts), args.request_rate, args.seed)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def scheduled(prompt: list[int], at: float, t0: float) -> RequestResult:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                return await one_request(client, url, headers, payload(prompt, args.output_len))
            async with sem:
                return await one_request(client, url, headers, payload(prompt, args.output_len))

        t0 = time.perf_counter()
        results = await asyncio.gather(*(scheduled(p, at, t0) for p, at in zip(prompts, offsets)))
        duration = time.perf_counter() - t0
    return list(results), duration


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
    s: dict = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": round(duration, 3),
               "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
               "request_throughput": round(len(ok) / duration, 3) if duration else 0.0,
               "output_throughput": round(out_tokens / duration, 1) if duration else 0.0,
               "total_token_throughput": round((in_tokens + out_tokens) / duration, 1) if duration else 0.0}
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
    for title, key in (("Time to First Token", "ttft_ms"), ("Time per Output Token (excl. 1st token)", "tpot_ms"),
                       ("Inter-token Latency", "itl_ms"), ("End-to-end Latency", "e2el_ms")):
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
    cmd = [sys.executable, "-m", "pagedllm", "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           *shlex.split(server_args)]
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
    from pagedllm import default_model_path
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (inf for all at once)")
    args.api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY")
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
        results, duration = asyncio.run(run_load(base_url, model, prompts, args))
    finally:
        if proc is not None:
            stop_server(proc)
    summary = summarize(results, duration)
    print(format_table(summary))
    config = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
              "max_concurrency": args.max_concurrency, "temperature": args.temperature, "seed": args.seed,
              "model": os.path.basename(os.path.normpath(args.model)) if args.model else model,
              "launched": bool(args.launch), "server_args": args.server_args if args.launch else None}
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
