"""AsyncLLM from Python, with the engine core in its own process and on a thread: streaming,
validation before streaming, abort, slow consumers, stop strings, queue limit, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.input_processor import MAX_SAMPLES
from pagedllm.entrypoints.async_llm import AsyncLLM, EngineShutdownError, QueueFullError
from tests.server.helpers import lockstep, pid_alive

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LLM_ARGS = dict(device="cpu", num_kv_blocks=128, block_size=8)


@pytest.fixture(scope="module")
def llm(tiny_models):
    from pagedllm import LLM

    return LLM(tiny_models["qwen3"], **LLM_ARGS)


@pytest.fixture(scope="module", params=["process", "thread", "process-async-scheduling"])
def engine(request, tiny_models):
    """One AsyncLLM per mode for the whole module; the shutdown test runs last in each mode.
    (process-async-scheduling: the core's engine launches step N+1 before step N's tokens are
    back, as `pagedllm serve --async-scheduling` runs it.)
    (The thread mode gets an LLM of its own: the `llm` fixture computes the references, and an
    LLM must not be stepped by two threads.)"""
    if request.param.startswith("process"):
        a = AsyncLLM(tiny_models["qwen3"], **LLM_ARGS, async_scheduling=request.param.endswith("async-scheduling"))
        assert a.llm is None and pid_alive(a.core_pid)
    else:
        from pagedllm import LLM

        a = AsyncLLM(llm=LLM(tiny_models["qwen3"], **LLM_ARGS))
    yield a
    a.shutdown()
    if request.param.startswith("process"):
        assert not pid_alive(a.core_pid) and a.core.exitcode() == 0
    else:
        assert a.llm.engine.kv.num_free_blocks == a.llm.engine.kv.num_blocks


async def _idle(engine: AsyncLLM, timeout: float = 60.0) -> dict:
    """The core's metrics once it has freed every block (it republishes them on going idle);
    the last ones after `timeout` s (a bound for a leak, not a speed: the caller asserts)."""
    deadline = time.monotonic() + timeout
    while True:
        m = engine.get_metrics()
        if (
            m["num_free_kv_blocks"] == m["num_kv_blocks"]
            and m["num_requests_running"] == 0
            or time.monotonic() > deadline
        ):
            return m
        await asyncio.sleep(0.02)


def test_stream_matches_offline_and_errors_come_first(engine, llm):
    offline = llm.generate(["def fib"], GREEDY, use_tqdm=False)[0].outputs[0]

    async def run():
        outs = [o async for o in engine.generate("def fib", GREEDY)]
        final = [o async for o in engine.generate("def fib", GREEDY, stream=False)]
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate("", GREEDY):
                pass
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request([10**9], GREEDY)
        with pytest.raises(ValueError, match="max_model_len"):
            engine.add_request([1] * engine.max_model_len, GREEDY)
        return outs, final

    outs, final = asyncio.run(run())
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == offline.token_ids
    assert outs[-1].outputs[0].text == offline.text and outs[-1].outputs[0].finish_reason == "length"
    assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text
    assert sum(len(o.outputs[0].delta_token_ids) for o in outs) == 12
    assert len(final) == 1 and final[0].outputs[0].text == offline.text
    m = outs[-1].metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time <= time.monotonic()


def test_stop_strings_match_the_engine(engine, llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = llm.generate(["def fib"], params, use_tqdm=False)[0].outputs[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    stopped = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    offline = llm.generate(["def fib"], stopped, use_tqdm=False)[0].outputs[0]
    assert offline.finish_reason == "stop"

    async def run():
        streamed = [o async for o in engine.generate("def fib", stopped)]
        final = [o async for o in engine.generate("def fib", stopped, stream=False)]
        return streamed, final[-1]

    streamed, final = asyncio.run(run())
    for out in (streamed[-1], final):
        o = out.outputs[0]
        assert (o.text, o.token_ids, o.finish_reason, o.stop_reason) == (offline.text, offline.token_ids, "stop", stop)
    assert "".join(o.outputs[0].delta_text for o in streamed) == offline.text
    asyncio.run(_idle(engine))  # the core was told to abort the rest


def test_parallel_sampling_matches_the_engine_and_stops_one_sample(engine, llm):
    """n=3: every output holds the three sequences (as LLM's); a stop string in one sample ends
    that sample only; MAX_SAMPLES bounds n and best_of (more than max_num_seqs run in waves,
    tests/model/test_parallel_sampling.py); the group frees its blocks."""
    kw = dict(temperature=1.0, top_k=50, max_tokens=10, ignore_eos=True, seed=4, n=3)
    params = SamplingParams(**kw)
    offline = llm.generate(["def fib"], params, use_tqdm=False)[0].outputs
    texts = [o.text for o in offline]
    assert len(set(texts)) == 3, texts
    pieces = (texts[0][i : i + 2] for i in range(1, len(texts[0]) - 2))
    stop = next((p for p in pieces if p.strip() and p not in texts[1] + texts[2]), None)
    assert stop is not None, texts
    stopped = SamplingParams(**kw, stop=[stop])

    async def run():
        outs = [o async for o in engine.generate("def fib", params)]
        cut = [o async for o in engine.generate("def fib", stopped)]
        with pytest.raises(ValueError, match=f"at most {MAX_SAMPLES}") as e:
            engine.add_request("x", SamplingParams(n=MAX_SAMPLES + 1))
        assert e.value.param == "n"
        with pytest.raises(ValueError, match=f"at most {MAX_SAMPLES}") as e:
            engine.add_request("x", SamplingParams(n=2, best_of=MAX_SAMPLES + 1))
        assert e.value.param == "best_of"
        return outs, cut, await _idle(engine)

    outs, cut, m = asyncio.run(run())
    assert all(len(o.outputs) == 3 and [c.index for c in o.outputs] == [0, 1, 2] for o in outs)
    assert [c.text for c in outs[-1].outputs] == texts and outs[-1].finished
    for i in range(3):
        assert "".join(o.outputs[i].delta_text for o in outs) == texts[i]
    assert [c.finish_reason for c in cut[-1].outputs] == ["stop", "length", "length"]
    assert cut[-1].outputs[0].text == texts[0][: texts[0].find(stop)]
    assert [c.text for c in cut[-1].outputs[1:]] == texts[1:]  # the others ran to the end
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]


def test_a_slow_consumer_gets_merged_deltas(engine):
    """A consumer that looks only after the request has finished gets one output with all of it."""

    async def run():
        stream = engine.add_request("import os", GREEDY)
        deadline = time.monotonic() + 120  # a bound for a hang, not a speed
        while not stream.done:  # the whole request finishes before the consumer looks
            assert time.monotonic() < deadline, "the request never finished"
            await asyncio.sleep(0.01)
        return [o async for o in stream]

    outs = asyncio.run(run())
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].delta_token_ids) == 12
    assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text
    assert [t for o in outs for t in o.outputs[0].delta_token_ids] == outs[-1].outputs[0].token_ids


@contextlib.contextmanager
def _at_first_token(engine: AsyncLLM, request_id: str, fn: Callable[[], None]) -> Iterator[None]:
    """Call fn() on the event loop right after the output handler has applied `request_id`'s
    first token, before it applies any later step's outputs: the request is unfinished then,
    however far the core has run ahead of this process (a consumer that awaits its first output
    first may find the whole request done)."""
    registry, real_apply = engine.registry, engine.registry.apply
    called = False

    def apply(outputs: list) -> None:
        nonlocal called
        real_apply(outputs)
        handle = registry.by_request_id.get(request_id)
        if not called and handle is not None and handle.started:
            called = True
            fn()

    registry.apply = apply
    try:
        yield
    finally:
        registry.apply = real_apply


def test_abort_and_leaving_early_free_blocks(engine):
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def run():
        with _at_first_token(engine, "a", lambda: engine.abort("a")):
            stream = engine.add_request("def f", long, request_id="a")
            rest = [o async for o in stream]
        gen = engine.generate("def g", long)
        async for _ in gen:
            break
        await gen.aclose()  # leaving the loop aborts the request
        return rest, await _idle(engine)

    rest, m = asyncio.run(run())
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert 1 <= len(rest[-1].outputs[0].token_ids) < 400
    assert m["kv_cache_usage"] == 0 and m["num_free_kv_blocks"] == m["num_kv_blocks"]


def test_queue_limit_duplicate_ids_and_shutdown(engine):
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def run():
        engine.max_queue_len = 0
        with pytest.raises(QueueFullError):
            engine.add_request("x", GREEDY)
        engine.max_queue_len = None
        with _at_first_token(engine, "dup", engine.begin_shutdown):  # while the request runs
            stream = engine.add_request("def f", long, request_id="dup")
            with pytest.raises(ValueError, match="already in use"):
                engine.add_request("def f", long, request_id="dup")
            outs = [o async for o in stream]  # ends cleanly
        with pytest.raises(EngineShutdownError):
            engine.add_request("x", GREEDY)
        return outs

    outs = asyncio.run(run())
    assert outs[-1].outputs[0].finish_reason == "abort" and 1 <= len(outs[-1].outputs[0].token_ids) < 400
    engine.shutdown()
    assert not engine.is_running


def test_stream_interval_sends_the_first_token_then_n_at_a_time(llm, tiny_models):
    """stream_interval=5, 12 tokens. A consumer that keeps up (the core in lockstep with it) gets
    the first token alone, then five at a time, then the last one: [1, 5, 5, 1]. A free-running
    one may be late and get merged outputs, but never a chunk of fewer than five tokens between
    its first and its last. Either way the tokens and text are the same as unstreamed. A bad
    value names the argument."""
    from pagedllm import LLM

    with pytest.raises(ValueError, match="stream_interval must be an integer >= 1"):
        AsyncLLM(stream_interval=0)
    want = llm.generate(["a b c"], GREEDY)[0].outputs[0]
    a = AsyncLLM(llm=LLM(tiny_models["qwen3"], **LLM_ARGS), stream_interval=5)

    async def run() -> list:
        return [out.outputs[0] async for out in a.generate("a b c", GREEDY)]

    try:
        with lockstep(a):
            kept_up = asyncio.run(run())
        free = asyncio.run(run())
    finally:
        a.shutdown()
    assert [len(o.delta_token_ids) for o in kept_up] == [1, 5, 5, 1]
    sizes = [len(o.delta_token_ids) for o in free]
    assert sum(sizes) == 12 and all(n >= 5 for n in sizes[1:-1]), sizes
    for outs in (kept_up, free):
        assert [t for o in outs for t in o.delta_token_ids] == want.token_ids
        assert "".join(o.delta_text for o in outs) == want.text == outs[-1].text


def test_more_samples_than_sequence_slots_stream_in_waves(tiny_models, llm):
    """The server's engine path (AsyncLLM over an engine-core process) with max_num_seqs=4 and n=10:
    three waves, every sample streamed under its index, each equal to the sample an engine with room
    for all ten draws (seed + index), and every block free afterwards."""
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=6, ignore_eos=True, seed=11, n=10)
    want = [o.token_ids for o in llm.generate(["def fib"], params, use_tqdm=False)[0].outputs]  # 256 slots: one wave
    small = AsyncLLM(tiny_models["qwen3"], **LLM_ARGS, max_num_seqs=4)
    try:

        async def run():
            outs = [o async for o in small.generate("def fib", params)]
            return outs, await _idle(small)

        outs, m = asyncio.run(run())
    finally:
        small.shutdown()
    final = outs[-1]
    assert final.finished and [c.index for c in final.outputs] == list(range(10))
    assert [c.token_ids for c in final.outputs] == want
    for i in range(10):  # the deltas add up to each sample, whichever wave it ran in
        assert [t for o in outs for t in o.outputs[i].delta_token_ids] == want[i]
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
