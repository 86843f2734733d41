"""The request timeline (engine/timeline.py): with PAGEDLLM_TIMELINE set, a streamed request through
the serving layer and the engine core leaves every stage of its life in the files, in the order it
lived them, and benchmarks/request_timeline.py's join turns them into non-negative stage times."""

from __future__ import annotations

import asyncio
import importlib.util
import os

from pagedllm.entrypoints.model_dir import bundled_model_path
from pagedllm.entrypoints.openai.serving import OpenAIServing, SSEStream

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "request_timeline", os.path.join(ROOT, "benchmarks/request_timeline.py")
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_streamed_request_leaves_its_timeline(tmp_path, monkeypatch):
    from pagedllm.entrypoints.async_llm import AsyncLLM

    prefix = str(tmp_path / "tl")
    monkeypatch.setenv("PAGEDLLM_TIMELINE", prefix)
    engine = AsyncLLM(bundled_model_path(), engine_process=False, device="cpu", num_kv_blocks=32)
    serving = OpenAIServing(engine, "m")
    body = {"model": "m", "prompt": "def f(x):", "max_tokens": 4, "stream": True, "request_id": "r1"}

    async def run() -> tuple[float, float]:
        start = asyncio.get_running_loop().time()
        stream = await serving.create_completion(body)
        assert isinstance(stream, SSEStream)
        first = None
        async for event in stream.events:
            if first is None and '"text"' in event:
                first = asyncio.get_running_loop().time()
        assert first is not None
        return start, first

    try:
        start, first = asyncio.run(run())
    finally:
        engine.shutdown()
    bench = _bench()
    events = bench.read_events(prefix)
    assert {"api", "core"} <= set(events)
    client = [{"user": "cmpl-r1", "ok": True, "start": start, "first_chunk": first, "ttft": first - start, "tpot": 0.0}]
    rows, steps = bench.join(client, events)
    assert len(rows) == 1 and steps["num_steps"] >= 4  # the prompt, then 3 more tokens
    stages = rows[0]["stages"]
    assert set(stages) == {k for k, _ in bench.FIRST_TOKEN_STAGES}
    assert all(v >= 0 for k, v in stages.items() if k not in ("client_to_handler", "sse_to_client")), stages
    assert len(rows[0]["core_gaps"]) == 3  # 4 tokens sent by the core, one step apart


def test_over_http_the_app_arrival_splits_the_client_to_handler_stage(tmp_path, monkeypatch):
    """Through uvicorn: with the timeline on, the app stamps each request's arrival, and the join
    cuts the client's send -> the handler there (client_to_app + app_to_handler == client_to_handler)."""
    import time

    import httpx

    from pagedllm.entrypoints.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.routes import build_app
    from tests.server.helpers import LiveServer

    prefix = str(tmp_path / "tl")
    monkeypatch.setenv("PAGEDLLM_TIMELINE", prefix)
    engine = AsyncLLM(bundled_model_path(), engine_process=False, device="cpu", num_kv_blocks=32)
    server = LiveServer(build_app(engine, "m")).start()
    clients = []
    try:
        for i, path in enumerate(("/completions", "/chat/completions")):
            body = {"model": "m", "max_tokens": 2, "stream": True, "request_id": f"h{i}"}
            body |= {"prompt": "def f(x):"} if i == 0 else {"messages": [{"role": "user", "content": "hi"}]}
            start = time.monotonic()
            with httpx.stream("POST", server.base_url + path, json=body, timeout=120) as r:
                assert r.status_code == 200
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            first = time.monotonic()
            assert lines[-1] == "data: [DONE]"
            user = f"{'cmpl' if i == 0 else 'chatcmpl'}-h{i}"
            clients.append({"user": user, "ok": True, "start": start, "first_chunk": first, "ttft": 0.0, "tpot": 0.0})
    finally:
        server.stop()
        engine.shutdown()
    bench = _bench()
    rows, _ = bench.join(clients, bench.read_events(prefix))
    assert len(rows) == 2
    for row in rows:
        s = row["stages"]
        assert s["client_to_app"] >= 0 and s["app_to_handler"] >= 0, s
        assert abs(s["client_to_app"] + s["app_to_handler"] - s["client_to_handler"]) < 1e-9
