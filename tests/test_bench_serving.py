"""The serving benchmark's pieces that need no server: workload, metrics, process count."""

import math

from pagedllm.bench.load_generator import client_process_count
from pagedllm.bench.metrics import format_table, summarize
from pagedllm.bench.request_func import RequestResult
from pagedllm.bench.workload import arrival_offsets


def test_arrivals_are_seeded_poisson_or_all_at_once():
    assert arrival_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]
    a = arrival_offsets(200, 50.0, 7)
    assert a == arrival_offsets(200, 50.0, 7) and a != arrival_offsets(200, 50.0, 8)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:], strict=False))
    assert 2.0 < a[-1] < 6.0  # 199 gaps of mean 1/50 s


def test_summary_counts_only_successes_and_names_vllm_metrics():
    ok = [
        RequestResult(ok=True, prompt_len=8, output_tokens=3, ttft=0.1, latency=0.3, itl=[0.1, 0.1]) for _ in range(2)
    ]
    s = summarize([*ok, RequestResult(error="HTTP 500: boom")], 2.0)
    assert (s["completed"], s["failed"], s["first_error"]) == (2, 1, "HTTP 500: boom")
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (16, 6)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0
    assert s["median_ttft_ms"] == 100.0 and s["mean_tpot_ms"] == 100.0 and s["p99_itl_ms"] == 100.0
    assert s["mean_e2el_ms"] == 300.0
    table = format_table(s)
    assert "Successful requests:" in table and table.endswith("first error: HTTP 500: boom")


def test_client_processes_never_exceed_the_prompts():
    assert client_process_count(8, 3) == 3
    assert client_process_count(0, 10) == 1  # fewer than 64 prompts: one process
