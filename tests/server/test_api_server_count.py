"""Several API processes over one engine core (`pagedllm serve --api-server-count N`,
entrypoints/openai/api_processes.py), checked where it can be made deterministic: two AsyncLLMs
attached to one core process, as two API processes are (each its own pipes, index and count of
waiting requests), on one event loop here. The server-level behaviour at N=2 (auth, limits, the
queue over both processes, SIGTERM, engine death, 1,000 streams half cancelled) is the existing
process tests run at N=1 and N=2: test_serve_process.py and tests/reliability."""

from __future__ import annotations

import asyncio
import multiprocessing
import subprocess
import sys
import time

import pytest

from pagedllm import SamplingParams
from pagedllm.entrypoints.async_llm import AsyncLLM
from pagedllm.entrypoints.core_client import CoreAttachment, SharedCore
from pagedllm.entrypoints.engine_state import QueueFullError
from tests.server.helpers import ROOT, pid_alive

NUM_KV_BLOCKS = 128
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def two_api_sides(server_model):
    """One core spawned for two clients, and an AsyncLLM attached to each pipe pair."""
    kwargs = dict(device="cpu", block_size=16, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=8)
    core = SharedCore({"model": server_model, **kwargs}, 2)
    info = core.wait_ready(300)
    waiting = multiprocessing.get_context("spawn").Array("q", 2, lock=False)
    sides = [AsyncLLM(server_model, attach=CoreAttachment(core.pipes[i], core.pid, info, i, waiting)) for i in range(2)]
    yield core, sides
    for side in sides:
        side.shutdown(30)
    core.close(30)
    assert not pid_alive(core.pid)


async def _collect(async_llm: AsyncLLM, prompt: str, params: SamplingParams) -> list[int]:
    final = None
    async for out in async_llm.generate(prompt, params):
        final = out
    assert final is not None
    return list(final.outputs[0].token_ids)


async def _until(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout  # a bound for a hang, not a speed
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def test_two_api_sides_share_one_core(two_api_sides, server_model):
    core, (a, b) = two_api_sides
    prompts = [f"def f{i}(x):" for i in range(6)]

    async def main():
        # each side's outputs come back to it, token for token what one side alone gets
        together = await asyncio.gather(*(_collect((a, b)[i % 2], p, GREEDY) for i, p in enumerate(prompts)))
        alone = [await _collect(a, p, GREEDY) for p in prompts]
        assert together == alone
        # the same request id on both sides: two requests, since their ids in the core differ
        same = await asyncio.gather(_collect_id(a, prompts[0], "dup"), _collect_id(b, prompts[1], "dup"))
        assert same == [alone[0], alone[1]]
        # a request whose sequences end in one step (n, best_of, beam search) gets all of them
        for params in (
            SamplingParams(temperature=0, max_tokens=5, n=3, ignore_eos=True),
            SamplingParams(temperature=0.8, max_tokens=5, n=2, best_of=3, seed=1),
            SamplingParams(use_beam_search=True, n=2, max_tokens=5, temperature=0, ignore_eos=True),
        ):
            outs = await asyncio.gather(*(_final(side, prompts[2], params) for side in (b, a)))
            assert [len(o.outputs) for o in outs] == [params.n, params.n]
            assert all(o.finished for o in outs)

        # the queue is counted over both sides: 8 sequence slots held by long requests on side a,
        # then side b's waiting requests count on side a too
        long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
        holders = [a.add_request(p, long) for p in prompts + prompts[:2]]
        await _until(lambda: a.get_metrics().get("num_requests_running") == 8)
        waiters = [b.add_request(p, GREEDY) for p in prompts[:3]]
        await _until(lambda: a.num_waiting() == 3 and b.num_waiting() == 3)
        assert a.registry.num_waiting == 0  # none of them is side a's own
        a.max_queue_len = 3
        with pytest.raises(QueueFullError):
            a.add_request("x", GREEDY)

        # a disconnect on either side frees its requests' KV in the shared core
        for h in holders:
            h.close()
        for w in waiters:
            w.close()
        await _until(lambda: _idle(a.get_metrics()) and _idle(b.get_metrics()))

    asyncio.run(asyncio.wait_for(main(), 600))  # a bound for a hang, not a speed

    # one side shutting down ends only its own requests; the other goes on with the core
    async def after():
        b.shutdown(30)
        assert pid_alive(core.pid)
        assert await _collect(a, prompts[0], GREEDY) == await _collect(a, prompts[0], GREEDY)

    asyncio.run(asyncio.wait_for(after(), 600))


async def _final(async_llm: AsyncLLM, prompt: str, params: SamplingParams):
    final = None
    async for out in async_llm.generate(prompt, params, stream=False):
        final = out
    assert final is not None
    return final


async def _collect_id(async_llm: AsyncLLM, prompt: str, request_id: str) -> list[int]:
    final = None
    async for out in async_llm.generate(prompt, GREEDY, request_id=request_id):
        final = out
    assert final is not None
    return list(final.outputs[0].token_ids)


def _idle(m: dict) -> bool:
    return (
        m.get("num_requests_running") == 0
        and m.get("num_requests_waiting") == 0
        and m.get("num_free_kv_blocks") == NUM_KV_BLOCKS
    )


def test_api_server_count_flag_refusals(tiny_models):
    cmd = [sys.executable, "-m", "pagedllm", "serve", "--model", tiny_models["qwen3"], "--device", "cpu", "--port", "0"]
    r = subprocess.run([*cmd, "--api-server-count", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--api-server-count: must be an integer in [1, 64], got 0" in r.stderr
    r = subprocess.run(
        [*cmd, "--api-server-count", "2", "--no-engine-process"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "pagedllm: error: --api-server-count 2 needs the engine core in its own process: drop --no-engine-process"
    )
