"""AsyncLLM from Python: streaming, validation before streaming, abort, slow consumers,
queue limit, shutdown."""
from __future__ import annotations

import asyncio

import pytest

from pagedllm import SamplingParams
from pagedllm.entrypoints.async_llm import AsyncLLM, EngineShutdownError, QueueFullError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    from pagedllm import LLM
    return LLM(tiny_models["qwen3"], device="cpu", num_kv_blocks=128, block_size=8)


@pytest.fixture
def engine(llm):
    a = AsyncLLM(llm=llm)
    yield a
    a.shutdown()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_stream_matches_offline_and_errors_come_first(engine, llm):
    offline = llm.generate(["def fib"], GREEDY, use_tqdm=False)[0].outputs[0]

    async def run():
        outs = [o async for o in engine.generate("def fib", GREEDY)]
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate("", GREEDY):
                pass
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request([10 ** 9], GREEDY)
        return outs
    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == offline.token_ids
    assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text
    assert sum(len(o.outputs[0].delta_token_ids) for o in outs) == 12


def test_a_slow_consumer_gets_merged_deltas(engine):
    async def run():
        stream = engine.add_request("import os", GREEDY)
        await asyncio.sleep(0.5)                  # the whole request finishes meanwhile
        return [o async for o in stream]
    outs = asyncio.run(run())
    assert len(outs) < 12
    assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text
    assert [t for o in outs for t in o.outputs[0].delta_token_ids] == outs[-1].outputs[0].token_ids


def test_abort_and_leaving_early_free_blocks(engine, llm):
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def run():
        stream = engine.add_request("def f", long, request_id="a")
        await stream.__anext__()
        engine.abort("a")
        rest = [o async for o in stream]
        gen = engine.generate("def g", long)
        async for _ in gen:
            break
        await gen.aclose()                        # leaving the loop aborts the request
        kv = llm.engine.kv
        for _ in range(100):                      # the engine thread frees them at its next step
            if kv.num_free_blocks == kv.num_blocks and engine.get_metrics()["kv_cache_usage"] == 0:
                break
            await asyncio.sleep(0.02)
        return rest
    rest = asyncio.run(run())
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert len(rest[-1].outputs[0].token_ids) < 400
    assert engine.get_metrics()["kv_cache_usage"] == 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_queue_limit_duplicate_ids_and_shutdown(engine):
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def run():
        engine.max_queue_len = 0
        with pytest.raises(QueueFullError):
            engine.add_request("x", GREEDY)
        engine.max_queue_len = None
        stream = engine.add_request("def f", long, request_id="dup")
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("def f", long, request_id="dup")
        await stream.__anext__()
        engine.begin_shutdown()
        outs = [o async for o in stream]          # ends cleanly
        with pytest.raises(EngineShutdownError):
            engine.add_request("x", GREEDY)
        return outs
    outs = asyncio.run(run())
    assert outs[-1].outputs[0].finish_reason == "abort"
    engine.shutdown()
    assert not engine.is_running
