"""Where a request's time goes, end to end: one server, a Poisson load, every stage timed.

Launches `pagedllm serve` with PAGEDLLM_TIMELINE set (engine/timeline.py: the API process and the
engine core each write their events), sends `--num-prompts` streamed completions at
`--request-rate` (each carrying its own `request_id`, so the three sides join), stops the server
and joins the client's times with the server's files into one timeline per request. Prints and
writes (JSON) the median and p90 of each stage of the first token, of a decode token and of the
core's steps, with one whole request's timeline as an example.

    python benchmarks/request_timeline.py --model /tmp/qwen3-0.6b --server-args "--device cuda" \
        --num-prompts 300 --request-rate 16 --out timeline.json
    python benchmarks/request_timeline.py --num-prompts 20 --input-len 32 --output-len 8   # CPU, bundled model

All times are time.monotonic(), one clock for every process of the host.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedllm.bench.request_func import completion_payload, http_client, one_request  # noqa: E402
from pagedllm.bench.server_process import launch_server, server_model_name, stop_server  # noqa: E402
from pagedllm.bench.workload import arrival_offsets, random_prompts  # noqa: E402

FIRST_TOKEN_STAGES = [
    ("client_to_handler", "client sends -> the route handler runs (connect, HTTP parse)"),
    ("parse_tokenize", "handler -> parsed, tokenized, checked (worker thread and back)"),
    ("to_core_pipe", "queued in the API process -> the core reads it (between steps: after the one it waits for)"),
    ("wait_for_step", "core has it -> a step that includes it starts being scheduled"),
    ("schedule_launch", "that step: schedule, inputs, launch (host)"),
    ("prefill_steps", "launched -> the first token is on the host (the prefill step(s) and the step before)"),
    ("core_outputs", "the first token on the host -> its outputs are sent"),
    ("to_api_pipe", "sent -> the API process reads it"),
    ("api_output", "read -> its SSE event is written (output processing, detokenizing, JSON)"),
    ("sse_to_client", "written -> the client has the chunk"),
]

# client_to_handler in two (both in it; not added to the sum): the app's arrival stamp
# (routes.ArrivalStamp) cuts it where uvicorn hands the parsed request head to the app
HTTP_PARTS = [
    ("client_to_app", "client sends -> the app has the request (client, connect, uvicorn's parse of the head)"),
    ("app_to_handler", "the app has it -> the route handler runs (middlewares, routing, reading the body)"),
]


def _q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def _stats(xs: list[float]) -> dict[str, float]:
    ms = [x * 1000 for x in xs]
    return {
        "median_ms": round(statistics.median(ms), 3) if ms else float("nan"),
        "p90_ms": round(_q(ms, 0.9), 3),
        "n": len(ms),
    }


def read_events(prefix: str) -> dict[str, list[dict[str, Any]]]:
    by_role: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in glob.glob(prefix + ".*.jsonl"):
        role = path[len(prefix) + 1 :].split(".")[0]
        with open(path, encoding="utf-8") as f:
            by_role[role] += [json.loads(line) for line in f]
    for rows in by_role.values():
        rows.sort(key=lambda r: r["t"])
    return by_role


def join(client: list[dict[str, Any]], ev: dict[str, list[dict[str, Any]]]) -> tuple[list[dict], dict]:
    """Per request: the time of every stage (seconds since the client sent it), and per-step stats."""
    api, core = ev.get("api", []), ev.get("core", [])
    user_of: dict[str, str] = {}
    api_t: dict[str, dict[str, float]] = defaultdict(dict)
    recv_t: dict[str, list[float]] = defaultdict(list)
    sse_t: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for r in api:
        if r["ev"] == "submit":
            user_of[r["rid"]] = r["user"]
            api_t[r["user"]]["submit"] = r["t"]
        elif r["ev"] in ("asgi", "http", "prepared"):
            api_t[r["user"]][r["ev"]] = r["t"]
        elif r["ev"] == "recv":
            for rid in r["rids"]:
                recv_t[user_of.get(rid, rid)].append(r["t"])
        elif r["ev"] == "sse":
            sse_t[r["user"]].append((r["t"], r["n"]))
    core_recv: dict[str, float] = {}
    sent_t: dict[str, list[float]] = defaultdict(list)
    launches: dict[int, dict] = {}
    resolves: dict[int, float] = {}
    first_launch: dict[str, int] = {}
    for r in core:
        if r["ev"] == "core_recv":
            core_recv[user_of.get(r["rid"], r["rid"])] = r["t"]
        elif r["ev"] == "launch":
            launches[r["step"]] = r
            for rid, _n in r["rows"]:
                first_launch.setdefault(user_of.get(rid, rid), r["step"])
        elif r["ev"] == "resolve":
            resolves[r["step"]] = r["t"]
        elif r["ev"] == "sent":
            for rid in r["rids"]:
                sent_t[user_of.get(rid, rid)].append(r["t"])
    resolve_times = sorted(resolves.values())
    rows = []
    for c in client:
        u = c["user"]
        a = api_t.get(u, {})
        if not c["ok"] or u not in first_launch or not sent_t.get(u) or not recv_t.get(u) or not sse_t.get(u):
            continue
        launch = launches[first_launch[u]]
        first_sent = sent_t[u][0]
        # the step that sampled the first token: the last one resolved before its outputs went out
        i = bisect.bisect_right(resolve_times, first_sent)
        first_resolve = resolve_times[i - 1] if i else first_sent
        first_sse = next(t for t, n in sse_t[u] if n > 0)
        stages = {
            "client_to_handler": a.get("http", c["start"]) - c["start"],
            "parse_tokenize": a.get("prepared", 0) - a.get("http", 0),
            "to_core_pipe": core_recv[u] - a.get("prepared", core_recv[u]),
            "wait_for_step": launch["t_sched"] - core_recv[u],
            "schedule_launch": launch["t"] - launch["t_sched"],
            "prefill_steps": first_resolve - launch["t"],
            "core_outputs": first_sent - first_resolve,
            "to_api_pipe": recv_t[u][0] - first_sent,
            "api_output": first_sse - recv_t[u][0],
            "sse_to_client": c["first_chunk"] - first_sse,
        }
        if "asgi" in a:
            stages["client_to_app"] = a["asgi"] - c["start"]
            stages["app_to_handler"] = a["http"] - a["asgi"]
        gaps = [b - a_ for a_, b in zip(sent_t[u], sent_t[u][1:], strict=False)]
        api_lag = [r_ - s_ for s_, r_ in zip(sent_t[u], recv_t[u], strict=False)]
        rows.append(
            {
                "user": u,
                "ttft": c["ttft"],
                "tpot": c["tpot"],
                "stages": stages,
                "core_gaps": gaps,
                "api_lag": api_lag,
                "prefill_step_rows": len(launch["rows"]),
            }
        )
    ids = sorted(launches)
    periods = [launches[b]["t"] - launches[a]["t"] for a, b in zip(ids, ids[1:], strict=False)]
    host = [launches[s]["t"] - launches[s]["t_sched"] for s in ids]
    waits = [resolves[s] - launches[s]["t"] for s in ids if s in resolves]
    batch = [len(launches[s]["rows"]) for s in ids]
    steps = {
        "launch_period": _stats(periods),
        "schedule_and_launch_host": _stats(host),
        "launch_to_resolve": _stats(waits),
        "median_rows": statistics.median(batch) if batch else 0,
        "num_steps": len(ids),
    }
    return rows, steps


async def drive(
    url: str, model: str, prompts: list[Any], offsets: list[float], output_len: int, tag: str = "tl"
) -> list[dict]:
    async with http_client() as client:
        t0 = time.monotonic()

        async def one(i: int) -> dict:
            delay = t0 + offsets[i] - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            payload = completion_payload(model, prompts[i], output_len, 0.0)
            payload["request_id"] = f"{tag}{i}"
            r = await one_request(client, url, {}, payload)
            n = len(r.itl)
            return {
                "user": f"cmpl-{tag}{i}",
                "ok": r.ok,
                "error": r.error,
                "start": r.start,
                "first_chunk": r.start + r.ttft,
                "ttft": r.ttft,
                "tpot": (sum(r.itl) / n) if n else 0.0,
            }

        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    ap.add_argument("--server-args", default="", help="extra `pagedllm serve` flags")
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--request-rate", type=float, default=16.0)
    ap.add_argument("--text-prompts", action="store_true", help="send text (as vLLM's client does), not token ids")
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the JSON here")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    from pagedllm import default_model_path
    from pagedllm.bench.common import environment

    model_dir = args.model or default_model_path()
    prompts: list[Any] = random_prompts(model_dir, args.num_prompts, args.input_len, args.seed)
    if args.text_prompts:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = [tok.decode(p) for p in prompts]
    offsets = arrival_offsets(len(prompts), args.request_rate, args.seed)
    prefix = os.path.join(tempfile.mkdtemp(prefix="pagedllm-timeline-"), "tl")
    os.environ["PAGEDLLM_TIMELINE"] = prefix
    proc, base = launch_server(model_dir, args.server_args, 600, None)
    try:
        name = server_model_name(base, None)
        warm = [p[:16] for p in prompts[:2]]
        asyncio.run(drive(base + "/v1/completions", name, warm, [0.0, 0.0], 4, tag="warm"))
        client = asyncio.run(drive(base + "/v1/completions", name, prompts, offsets, args.output_len))
    finally:
        stop_server(proc)
        del os.environ["PAGEDLLM_TIMELINE"]
    rows, steps = join(client, read_events(prefix))
    first = {k: _stats([r["stages"][k] for r in rows]) for k, _ in FIRST_TOKEN_STAGES}
    http_parts = {k: _stats([r["stages"][k] for r in rows if k in r["stages"]]) for k, _ in HTTP_PARTS}
    out = {
        "benchmark": "request_timeline",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "requests_joined": len(rows),
        "failed": sum(1 for c in client if not c["ok"]),
        "ttft": _stats([r["ttft"] for r in rows]),
        "tpot": _stats([r["tpot"] for r in rows]),
        "first_token_stages": first,
        "http_parts": http_parts,
        "stage_meaning": dict(FIRST_TOKEN_STAGES + HTTP_PARTS),
        "decode": {
            "core_output_gap": _stats([g for r in rows for g in r["core_gaps"]]),
            "core_to_api_lag": _stats([g for r in rows for g in r["api_lag"]]),
        },
        "steps": steps,
        "example": rows[len(rows) // 2] if rows else None,
        **environment(),
    }
    if out["example"]:
        ex = out["example"]
        ex["core_gaps"] = [round(g * 1000, 3) for g in ex["core_gaps"]]
        ex["api_lag"] = [round(g * 1000, 3) for g in ex["api_lag"]]
        ex["stages"] = {k: round(v * 1000, 3) for k, v in ex["stages"].items()}
    print(f"{len(rows)} requests joined; TTFT median {out['ttft']['median_ms']} ms, TPOT {out['tpot']['median_ms']} ms")
    total = 0.0
    for k, meaning in FIRST_TOKEN_STAGES:
        total += first[k]["median_ms"]
        print(f"  {k:<18} {first[k]['median_ms']:>8.3f} ms  (p90 {first[k]['p90_ms']:>8.3f})  {meaning}")
    print(f"  {'sum of medians':<18} {total:>8.3f} ms")
    for k, meaning in HTTP_PARTS:
        h = http_parts[k]
        print(f"  (of client_to_handler) {k:<15} {h['median_ms']:>8.3f} ms  (p90 {h['p90_ms']:>8.3f})  {meaning}")
    d = out["decode"]
    print(
        f"decode: core output gap {d['core_output_gap']['median_ms']} ms, core->API {d['core_to_api_lag']['median_ms']} ms"
    )
    print(
        f"steps: period {steps['launch_period']['median_ms']} ms, host schedule+launch "
        f"{steps['schedule_and_launch_host']['median_ms']} ms, launch->resolve {steps['launch_to_resolve']['median_ms']} ms, "
        f"rows {steps['median_rows']}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
