"""The request-path benchmarks run end to end at small sizes: request_prep.py (preparation of each
body kind, no server) and client_ceiling.py (this project's client against the stand-in server,
which must speak the completions stream a client reads: every request's tokens and its usage) and
sse_chain.py (the app's layers around each SSE event)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, *args: str, out) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", script), *args, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1
    return rows[0]


def test_request_prep_times_each_body_kind(tmp_path):
    row = run("request_prep.py", "--num-bodies", "12", "--rounds", "1", "--input-len", "32", out=tmp_path / "p.jsonl")
    res = row["results"]
    kinds = {"prepare_token_ids_us", "prepare_text_us", "prepare_chat_us", "prepare_text_fresh_us"}
    assert set(res) == kinds | {"log_line_us", "to_thread_hop_us"}
    assert all(v > 0 for v in res.values())


def test_client_ceiling_streams_every_token_to_this_projects_client(tmp_path):
    results = os.path.join(ROOT, "benchmarks", "results")
    before = {f: os.path.getmtime(os.path.join(results, f)) for f in os.listdir(results)}
    args = ["--client", "pagedllm", "--num-prompts", "6", "--input-len", "16", "--output-len", "5"]
    row = run("client_ceiling.py", *args, "--batch", "4", "--step-ms", "2", out=tmp_path / "c.jsonl")
    after = {f: os.path.getmtime(os.path.join(results, f)) for f in os.listdir(results)}
    assert after == before  # the client's rows against a stand-in are not saved beside the real ones
    # 6 requests over 4 slots: two rounds of 5 steps of 2 ms
    assert row["ideal_req_s"] == round(6 / (2 * 5 * 0.002), 1)
    assert row["measured_req_s"] is not None and 0 < row["measured_req_s"] <= row["ideal_req_s"]
    assert row["client_cpu_s"] > 0


def test_sse_chain_streams_every_event_through_the_app(tmp_path):
    """The app is driven for real: a route that did not stream would fail the script's own count."""
    row = run("sse_chain.py", "--events", "200", "--rounds", "1", out=tmp_path / "s.jsonl")
    assert row["events"] == 200 and row["results"]["app_us_per_event"] > 0 and row["results"]["bare_us_per_event"] > 0
