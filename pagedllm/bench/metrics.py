"""The serving benchmark's metrics, named as vLLM's `bench serve` names them.

Over the successful requests only (a failed one counts in `failed` and gives `first_error`):
throughputs per second of `duration`; TTFT, TPOT, ITL and E2EL (end-to-end latency) as mean,
median and p99, in ms, where TPOT = (latency - TTFT) / (output tokens - 1) per request with
more than one output token, and ITL = every gap between two token chunks of a request.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from pagedllm.bench.request_func import RequestResult


def _percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0 for no data."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """The `results` row of a benchmark run: counts, throughputs, and the latency statistics in ms."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ttft = [r.ttft * 1000 for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok if r.output_tokens > 1]
    itl = [x * 1000 for r in ok for x in r.itl]
    e2e = [r.latency * 1000 for r in ok]
    s: dict[str, Any] = {
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


def format_table(s: dict[str, Any]) -> str:
    """The summary as vLLM's `bench serve` prints it (50 columns)."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: object) -> None:
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
