"""The server's own share of a request's first token, one request at a time: from the client's
send to the engine core holding the request, with no client library and no load in the way.

`benchmarks/request_timeline.py` times every stage under a Poisson load through an HTTP client
library, whose own time (building the request, its event loop) lands in `client_to_handler`.
Here the client is a plain socket on one kept-alive connection that sends prebuilt request bytes
and reads the stream to its end before the next request, so each stage is the server's:

    send_to_handler     the bytes are sent -> the route handler runs (uvicorn, the ASGI stack)
    handler_to_prepared parsed, tokenized, checked (serving.py: on the loop or a worker thread)
    prepared_to_submit  queued in AsyncLLM and written to the core's pipe
    submit_to_core      the core process has read it
    (the model's steps: not timed here)
    core_to_api         the first token's outputs: sent by the core -> read by the API process
    recv_to_applied     output processing (detokenizing), the stream woken
    applied_to_resumed  -> the stream's task runs (the loop's turn)
    resumed_to_built    its SSE events' JSON made
    built_to_sse        -> written to the socket (Starlette's response, the middlewares, uvicorn)
    sse_to_client       written -> the client's socket has the event

Launches `pagedllm serve` (PAGEDLLM_TIMELINE set) from whatever `pagedllm` is importable, so
another tree can be measured with the same script (run it from outside the repository with
PYTHONPATH=OLD_TREE). Medians over the requests after the first few.

    python benchmarks/request_path.py [--model DIR] [--text-prompts] [--num-prompts 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

STAGES = [
    ("send_to_handler", "send", "http"),
    ("handler_to_prepared", "http", "prepared"),
    ("prepared_to_submit", "prepared", "submit"),
    ("submit_to_core", "submit", "core_recv"),
]
RETURN_STAGES = [
    ("core_to_api", "core_sent", "api_recv"),
    ("recv_to_applied", "api_recv", "applied"),
    ("applied_to_resumed", "applied", "resumed"),
    ("resumed_to_built", "resumed", "built"),
    ("built_to_sse", "built", "sse"),
    ("sse_to_client", "sse", "client_first"),
]


def request_bytes(host: str, body: dict[str, Any]) -> bytes:
    raw = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
    return (head + f"content-length: {len(raw)}\r\n\r\n").encode() + raw


def read_stream(sock: socket.socket) -> float:
    """Read one chunked SSE response to its last chunk; returns when its first token arrived."""
    buf, first = b"", 0.0
    while not (b"[DONE]" in buf and buf.endswith(b"0\r\n\r\n")):
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        buf += data
        if not first and b'"text"' in buf:
            first = time.monotonic()
    return first


def events(prefix: str) -> dict[str, dict[str, float]]:
    """user request id -> {event: time} from the API and core timeline files."""
    by_user: dict[str, dict[str, float]] = {}
    core_to_user: dict[str, str] = {}
    rows = []
    for path in glob.glob(prefix + ".*.jsonl"):
        with open(path, encoding="utf-8") as f:
            rows += [json.loads(line) for line in f]
    for r in rows:
        if r["ev"] in ("http", "prepared", "submit"):
            by_user.setdefault(r["user"], {})[r["ev"]] = r["t"]
        if r["ev"] == "submit":
            core_to_user[r["rid"]] = r["user"]
    for r in sorted(rows, key=lambda r: r["t"]):  # each request's first "sent", "recv" and "sse"
        if r["ev"] == "core_recv" and r["rid"] in core_to_user:
            by_user[core_to_user[r["rid"]]]["core_recv"] = r["t"]
        for ev, key in (("sent", "core_sent"), ("recv", "api_recv"), ("applied", "applied")):
            if r["ev"] == ev:
                for rid in r["rids"]:
                    if rid in core_to_user:
                        by_user[core_to_user[rid]].setdefault(key, r["t"])
        if r["ev"] in ("resumed", "built", "sse") and r["user"] in by_user:
            by_user[r["user"]].setdefault(r["ev"], r["t"])
    return by_user


def main() -> int:
    import pagedllm
    from pagedllm.bench.common import append_json_line, environment
    from pagedllm.bench.server_process import launch_server, server_model_name, stop_server

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    ap.add_argument("--server-args", default="--disable-uvicorn-access-log", help="extra `pagedllm serve` flags")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--text-prompts", action="store_true", help="send text (as vLLM's client does), not token ids")
    ap.add_argument("--skip", type=int, default=5, help="first requests left out of the medians")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None, help="append the result as one JSON line")
    args = ap.parse_args()
    model = args.model or str(pagedllm.default_model_path())
    prefix = os.path.join(tempfile.mkdtemp(prefix="pagedllm-path-"), "tl")
    os.environ["PAGEDLLM_TIMELINE"] = prefix
    rng = random.Random(0)
    prompts: list[Any] = [[rng.randrange(100, 8000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    if args.text_prompts:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        prompts = [tokenizer.decode(p) for p in prompts]
    proc, base = launch_server(model, args.server_args, 600, None)
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    try:
        name = server_model_name(base, None)
        host, port = base.split("//")[1].rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i, prompt in enumerate(prompts):
                body = {"model": name, "prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True}
                raw = request_bytes(host, {**body, "request_id": f"p{i}"})
                t = time.monotonic()
                sock.sendall(raw)
                sent[f"cmpl-p{i}"] = t
                first[f"cmpl-p{i}"] = read_stream(sock)
                time.sleep(0.05)
    finally:
        stop_server(proc)
        del os.environ["PAGEDLLM_TIMELINE"]
    ev = events(prefix)
    rows = [{"send": t, "client_first": first[u], **ev[u]} for u, t in sent.items() if u in ev][args.skip :]

    def medians(stages: list[tuple[str, str, str]]) -> dict[str, float]:
        got = {
            name: round(statistics.median((r[b] - r[a]) * 1e3 for r in rows), 3)
            for name, a, b in stages
            if all(a in r and b in r for r in rows)
        }
        got["sum_of_medians"] = round(sum(got.values()), 3)
        return got

    stages, back = medians(STAGES), medians(RETURN_STAGES)
    out = {
        "benchmark": "request_path",
        "label": args.label,
        "text_prompts": args.text_prompts,
        "input_len": args.input_len,
        "requests": len(rows),
        "median_ms": stages,
        "first_token_back_median_ms": back,
        "ttft_median_ms": round(statistics.median((r["client_first"] - r["send"]) * 1e3 for r in rows), 3),
        **environment(),
    }
    print(json.dumps(out))
    append_json_line(out, args.out)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
