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
