"""What the app's layers cost a streamed SSE event, without a socket or an engine (CPU time).

The serving app's middlewares (`InternalErrorMiddleware`, `BodyGuard`, Starlette's own) and
`SSEResponse` (Starlette's StreamingResponse) sit between a stream's events and uvicorn's `send`.
This drives the real classes as an ASGI app with a `send` that does nothing, over N events of the
size of a completion chunk, and compares the CPU time an event with a bare loop that encodes each
event and awaits the same `send`: the difference is what the layers cost.

    python benchmarks/sse_chain.py [--events 20000] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fastapi import FastAPI, Request  # noqa: E402  (module level: FastAPI resolves the handler's annotations here)

EVENT = (
    'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
    '"choices":[{"index":0,"text":" hello","logprobs":null,"finish_reason":null}]}\n\n'
)


def build(n: int) -> Any:
    from pagedllm.entrypoints.openai.answers import SSEStream
    from pagedllm.entrypoints.openai.errors import InternalErrorMiddleware
    from pagedllm.entrypoints.openai.guards import BodyGuard
    from pagedllm.entrypoints.openai.routes import SSEResponse

    async def events() -> Any:
        for _ in range(n):
            yield EVENT

    app = FastAPI()

    @app.post("/s")
    async def stream(request: Request) -> Any:
        await request.body()
        return SSEResponse(SSEStream(events(), lambda: None))

    app.add_middleware(BodyGuard, max_body_size=1 << 20)
    app.add_middleware(InternalErrorMiddleware)
    return app, events


async def one_round(n: int) -> tuple[float, float]:
    app, events = build(n)

    done = False

    async def receive() -> Any:
        nonlocal done
        if not done:
            done = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await asyncio.sleep(3600)  # no disconnect

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/s",
        "raw_path": b"/s",
        "root_path": "",
        "scheme": "http",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "http_version": "1.1",
        "asgi": {"version": "3.0"},
    }
    sent = 0

    async def counting_send(message: Any) -> None:
        nonlocal sent
        sent += message["type"] == "http.response.body" and bool(message.get("body"))

    start = time.process_time()
    await app(scope, receive, counting_send)
    assert sent == n, f"the app sent {sent} of {n} events"
    app_us = (time.process_time() - start) / n * 1e6
    start = time.process_time()
    async for event in events():
        await counting_send({"type": "http.response.body", "body": event.encode(), "more_body": True})
    bare_us = (time.process_time() - start) / n * 1e6
    return app_us, bare_us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None, help="append the result as one JSON line")
    args = p.parse_args()
    from pagedllm.bench.common import append_json_line, environment

    rows = [asyncio.run(one_round(args.events)) for _ in range(args.rounds)]
    app_us = statistics.median(r[0] for r in rows)
    bare_us = statistics.median(r[1] for r in rows)
    out = {
        "benchmark": "sse_chain",
        "events": args.events,
        "label": args.label,
        "results": {"app_us_per_event": round(app_us, 2), "bare_us_per_event": round(bare_us, 2)},
        "layers_us_per_event": round(app_us - bare_us, 2),
    }
    out.update(environment())
    print(json.dumps(out))
    append_json_line(out, args.out)


if __name__ == "__main__":
    main()
