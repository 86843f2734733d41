"""Scheduling never changes results: the shadow-KV runner gives the reference output under
every block size, token budget, pool size, prefix-caching setting and arrival order."""

import random

import pytest

from pagedllm.engine import LLMEngine, SamplingParams, SchedulerConfig
from tests.engine.fake_runner import ShadowRunner, reference_generate


def make_workload(seed: int, n: int = 12):
    rng = random.Random(seed)
    shared = [rng.randrange(97) for _ in range(40)]
    reqs = []
    for i in range(n):
        own = [rng.randrange(97) for _ in range(rng.randrange(1, 30))]
        prompt = (shared[: rng.randrange(0, 41)] + own) if i % 3 else own
        reqs.append((f"r{i}", prompt, rng.randrange(1, 25)))
    return reqs


def run(
    reqs,
    *,
    block_size=16,
    budget=64,
    blocks=64,
    prefix=True,
    max_num_seqs=8,
    order_seed=None,
    abort=(),
    async_scheduling=False,
):
    cfg = SchedulerConfig(
        num_kv_blocks=blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=256,
        enable_prefix_caching=prefix,
    )
    runner = ShadowRunner(block_size)
    engine = LLMEngine(cfg, runner, async_scheduling=async_scheduling)
    assert engine.async_scheduling == async_scheduling
    pending = list(reqs)
    if order_seed is not None:
        random.Random(order_seed).shuffle(pending)
    results = {}
    aborted = []
    added = set()
    step = 0
    while pending or engine.has_unfinished_requests():
        # arrivals trickle in: two per step
        for _ in range(2):
            if pending:
                rid, prompt, max_tokens = pending.pop(0)
                engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
                added.add(rid)
        for rid in abort:
            if step == 3 and rid in added and rid not in results:  # queued and not finished
                assert engine.abort_request(rid)
                aborted.append(rid)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        engine.kv.pool.check_invariants()
        check_registered_blocks_hold_their_kv(engine, runner)
        step += 1
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.aborted = aborted
    return results, engine, runner


def check_registered_blocks_hold_their_kv(engine, runner):
    """A findable block's KV is written (in launch order, as on a device) and is its tokens' KV."""
    bs = engine.kv.block_size
    for b in engine.kv.pool.blocks:
        if b.token_ids is not None:
            written = [runner.shadow.get(b.block_id * bs + j) for j in range(bs)]
            assert [w and w[1] for w in written] == list(b.token_ids), (b, written)


def expected(reqs):
    return {rid: reference_generate(p, m) for rid, p, m in reqs}


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("prefix", [True, False])
def test_block_sizes_and_prefix_caching(block_size, prefix):
    reqs = make_workload(1)
    results, engine, _ = run(reqs, block_size=block_size, prefix=prefix, blocks=4096 // block_size)
    assert results == expected(reqs)
    if prefix:
        assert engine.get_metrics()["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("budget", [1, 2, 7, 16, 1000])
def test_token_budgets_chunk_prefills(budget):
    reqs = make_workload(2)
    results, _, runner = run(reqs, budget=budget, block_size=8, blocks=512)
    assert results == expected(reqs)
    if budget == 16:
        assert runner.decode_and_prefill_mixed > 0


@pytest.mark.parametrize("block_size", [4, 16])
def test_small_pool_forces_preemption(block_size):
    reqs = make_workload(3, n=10)
    results, engine, _ = run(reqs, block_size=block_size, blocks=96 // block_size + 2, budget=32)
    assert results == expected(reqs)
    assert engine.get_metrics()["num_preemptions"] > 0


@pytest.mark.parametrize("order_seed", range(4))
def test_random_arrival_orders(order_seed):
    reqs = make_workload(4)
    results, _, _ = run(reqs, order_seed=order_seed, block_size=8, blocks=40, budget=24)
    assert results == expected(reqs)


def test_aborts_in_the_middle_leave_others_intact():
    reqs = make_workload(5)
    results, engine, _ = run(reqs, abort=("r0", "r2", "r3", "r5"), block_size=8, blocks=200)
    assert len(engine.aborted) >= 2
    exp = expected(reqs)
    for rid in engine.aborted:
        assert rid not in results
    assert {k: v for k, v in exp.items() if k not in engine.aborted} == results


def test_shadow_runner_detects_wrong_slots():
    """The harness itself can fail: corrupt one block table entry and outputs change."""
    reqs = make_workload(6, n=4)
    cfg = SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=256)
    runner = ShadowRunner(4)
    engine = LLMEngine(cfg, runner)
    for rid, p, m in reqs:
        engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    results = {}
    corrupted = False
    while engine.has_unfinished_requests():
        if not corrupted and engine.scheduler.running and len(engine.scheduler.running[0].block_table) > 1:
            t = engine.scheduler.running[0].block_table
            t[0], t[1] = t[1], t[0]
            corrupted = True
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    assert corrupted and results != expected(reqs)


ASYNC_CASES = {
    "bs8": dict(block_size=8, blocks=512),
    "bs1_no_prefix": dict(block_size=1, blocks=4096, prefix=False),
    "chunked": dict(block_size=8, blocks=512, budget=7),
    "preemption": dict(block_size=4, blocks=26, budget=32),
    "orders": dict(block_size=8, blocks=40, budget=24, order_seed=3),
}


@pytest.mark.parametrize("case", list(ASYNC_CASES))
def test_async_scheduling_gives_the_same_outputs(case):
    """Async scheduling: the next step is scheduled before the previous step's tokens are on
    the host (placeholders); outputs must not change, whatever else happens."""
    reqs = make_workload(7, n=10)
    results, engine, _ = run(reqs, async_scheduling=True, **ASYNC_CASES[case])
    assert results == expected(reqs)
    if case == "preemption":
        assert engine.get_metrics()["num_preemptions"] > 0
    if case == "chunked":
        assert engine.get_metrics()["prefix_cache_hit_tokens"] > 0


def test_async_scheduling_with_aborts():
    reqs = make_workload(5)
    results, engine, _ = run(reqs, abort=("r0", "r2", "r3", "r5"), block_size=8, blocks=200, async_scheduling=True)
    assert len(engine.aborted) >= 2
    exp = expected(reqs)
    assert {k: v for k, v in exp.items() if k not in engine.aborted} == results
