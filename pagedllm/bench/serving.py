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
import math
import os
import sys

from pagedllm.bench.load_generator import client_process_count, completions_load, run_load, warmup
from pagedllm.bench.metrics import format_table, summarize
from pagedllm.bench.server_process import launch_server, server_model_name, stop_server
from pagedllm.bench.workload import arrival_offsets, random_prompts


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


def main(args: argparse.Namespace) -> int:
    from pagedllm import default_model_path, envs

    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (inf for all at once)")
    api_key = args.api_key or envs.api_key()
    if args.launch and not args.model:
        raise ValueError("--launch needs --model")
    tokenizer_dir = args.tokenizer or args.model or default_model_path()
    prompts = random_prompts(tokenizer_dir, args.num_prompts, args.input_len, args.seed)
    client_processes = client_process_count(args.client_processes, args.num_prompts)
    proc = None
    base_url = args.base_url or "http://127.0.0.1:8000"
    try:
        if args.launch:
            proc, base_url = launch_server(args.model, args.server_args, args.launch_timeout, api_key)
        model = args.served_model_name or server_model_name(base_url, api_key)
        load = completions_load(base_url, model, api_key, args.temperature, args.output_len, args.max_concurrency)
        warmup(load, prompts, args.warmup_requests)
        offsets = arrival_offsets(len(prompts), args.request_rate, args.seed)
        results, duration = run_load(load, prompts, offsets, client_processes)
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
        "client_processes": client_processes,
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
