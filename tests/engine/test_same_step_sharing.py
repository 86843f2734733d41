"""Blocks become findable when the step that writes them is scheduled: requests admitted later in
the same step (and in the next one, under async scheduling) hit them. Exact (outputs equal those
with prefix caching off) and real (hit tokens counted) under chunked prefill, async scheduling,
preemption and aborts; a step that never runs leaves nothing findable; preemption never inflates
the hit statistics."""

from __future__ import annotations

import random

import pytest

from pagedllm.engine.sequence import SequenceStatus
from tests.engine.fake_runner import reference_generate
from tests.engine.sharing_harness import ExecutorFailure, Req, make_engine, run

SYNC_ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def burst(seed: int, k: int = 6, shared_len: int = 40, n: int = 1, max_tokens: int = 8) -> list[Req]:
    """k requests behind one shared prefix, each with 1-6 own tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(97) for _ in range(shared_len)]
    return [
        Req(
            f"r{i}",
            shared + [rng.randrange(97) for _ in range(rng.randrange(1, 7))],
            max_tokens,
            n=n,
            seed=seed + 10 * i,
        )
        for i in range(k)
    ]


def expected(reqs: list[Req]) -> dict[str, list[list[int]]]:
    return {r.rid: r.expected() for r in reqs}


@SYNC_ASYNC
@pytest.mark.parametrize("block_size", [4, 16])
def test_a_burst_shares_the_prefix_in_its_first_step(block_size, async_scheduling):
    reqs = burst(1)
    results, engine, runner = run(reqs, block_size=block_size, async_scheduling=async_scheduling)
    assert results == expected(reqs)
    m = engine.get_metrics()
    full = 40 // block_size * block_size
    assert m["prefix_cache_hit_tokens"] == 5 * full  # all but the first hit the whole shared prefix
    assert runner.executed_prompt_tokens == sum(len(r.prompt) for r in reqs) - 5 * full
    assert runner.shared_writes > 0  # the first request wrote blocks the others already held
    off, engine_off, _ = run(reqs, block_size=block_size, async_scheduling=async_scheduling, prefix=False)
    assert off == results and engine_off.get_metrics()["prefix_cache_hit_tokens"] == 0


def test_registering_blocks_before_their_step_is_caught():
    """The harness can fail: registering a chunk's last, partly scheduled block makes a block
    findable before all its KV is written, and check_state says so."""
    from pagedllm.engine.kv_cache_manager import KVCacheManager

    orig = KVCacheManager.cache_full_blocks

    def eager(self, seq, num):  # every allocated block, as if its tokens were all scheduled
        return orig(self, seq, len(seq.block_table) * self.block_size)

    KVCacheManager.cache_full_blocks = eager  # type: ignore[method-assign]
    try:
        with pytest.raises(AssertionError):
            run(burst(1, k=2), block_size=4, budget=10)
    finally:
        KVCacheManager.cache_full_blocks = orig  # type: ignore[method-assign]


@SYNC_ASYNC
@pytest.mark.parametrize("budget", [5, 10, 23])
def test_chunked_prefill_sharing_is_exact(budget, async_scheduling):
    reqs = burst(2, k=5, shared_len=37)
    results, engine, _ = run(reqs, block_size=4, budget=budget, async_scheduling=async_scheduling, per_step=2)
    assert results == expected(reqs)
    assert engine.get_metrics()["prefix_cache_hit_tokens"] > 0


@SYNC_ASYNC
@pytest.mark.parametrize("block_size", [4, 8])
def test_preemption_with_same_step_sharing_is_exact(block_size, async_scheduling):
    reqs = burst(3, k=8, shared_len=24, max_tokens=20)
    blocks = 3 * (-(-50 // block_size)) + 2
    results, engine, _ = run(
        reqs, block_size=block_size, num_kv_blocks=blocks, budget=32, async_scheduling=async_scheduling
    )
    assert results == expected(reqs)
    m = engine.get_metrics()
    assert m["num_preemptions"] > 0 and m["prefix_cache_hit_tokens"] > 0


@SYNC_ASYNC
def test_abort_the_writer_of_shared_blocks(async_scheduling):
    """The request whose step wrote the shared prefix is aborted right after: the sharers keep the
    blocks (ref counts) and their outputs are unchanged."""
    reqs = burst(4, k=4)
    results, engine, _ = run(reqs, block_size=4, abort={1: ["r0"], 3: ["r2"]}, async_scheduling=async_scheduling)
    assert results == {k: v for k, v in expected(reqs).items() if k in ("r1", "r3")}
    assert engine.get_metrics()["prefix_cache_hit_tokens"] == 3 * 40


@SYNC_ASYNC
def test_preempted_groups_go_back_together(async_scheduling):
    """n > 1 groups in a pool too small for all: whenever a step preempts a request's sequence, every
    sequence of that request not scheduled in that step goes back too, in index order."""
    rng = random.Random(5)
    reqs = [
        Req(f"g{i}", [rng.randrange(97) for _ in range(rng.randrange(5, 14))], 16, n=4, seed=7 * i) for i in range(4)
    ]
    reqs.append(Req("solo", [rng.randrange(97) for _ in range(9)], 16))
    seen = {"preempted_groups": 0}

    def instrument(engine, runner, step):
        if step:
            return
        scheduler = engine.scheduler
        schedule = scheduler.schedule

        def checked():
            before = {s.seq_id: s.status for s in runner.live_sequences()}
            out = schedule()
            scheduled = {s.seq.seq_id for s in out.scheduled} | {c.seq_id for s in out.scheduled for c in s.forks}
            for rid, seqs in engine.core.requests.items():
                newly = [
                    s
                    for s in seqs
                    if before.get(s.seq_id) is SequenceStatus.RUNNING and s.status is SequenceStatus.PREEMPTED
                ]
                if not newly:
                    continue
                seen["preempted_groups"] += len(newly) > 1
                for s in seqs:
                    if s.status is SequenceStatus.RUNNING:
                        assert s.seq_id in scheduled, (rid, s)
                waiting = [s for s in scheduler.waiting if s.request_id == rid]
                idx = [seqs.index(s) for s in waiting]
                assert idx == sorted(idx), (rid, idx)
                pos = [i for i, s in enumerate(scheduler.waiting) if s.request_id == rid]
                assert pos == list(range(pos[0], pos[0] + len(pos))), (rid, pos)  # together
            return out

        scheduler.schedule = checked  # type: ignore[method-assign]

    results, engine, _ = run(
        reqs, block_size=4, num_kv_blocks=30, budget=16, async_scheduling=async_scheduling, on_step=instrument
    )
    assert results == expected(reqs)
    assert engine.get_metrics()["num_preemptions"] > 0
    assert seen["preempted_groups"] > 0  # some step preempted several sequences of one request


# ---- a step that never runs -------------------------------------------------------------------
def finish_after_failure(engine, runner, reqs: list[Req]) -> dict[str, list[list[int]]]:
    """Abort what the failure left, check nothing is held, then run `reqs` on the repaired fake."""
    for rid in list(engine.core.requests):
        engine.abort_request(rid)
    assert not engine.has_unfinished_requests()  # the failed launch is not in flight any more
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    runner.fail_at, runner.fail_result_at = set(), set()
    for r in reqs:
        engine.add_request(r.rid, r.prompt, r.params())
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [o.token_ids for o in out.outputs]
    return done


@SYNC_ASYNC
@pytest.mark.parametrize("fail_at", [1, 2])
def test_blocks_of_a_failed_step_are_not_findable(fail_at, async_scheduling):
    """Chunks of 16 (block size 4) over a 40-token prompt sent twice; launch `fail_at` raises.
    Only what earlier launches wrote can be hit afterwards."""
    prompt = list(range(40))
    engine, runner = make_engine(block_size=4, budget=16, async_scheduling=async_scheduling, fail_at=[fail_at])
    engine.add_request("a", prompt, Req("a", prompt, 5).params())
    engine.add_request("b", prompt, Req("b", prompt, 5).params())
    with pytest.raises(ExecutorFailure):
        for _ in range(fail_at):
            engine.step()
    hits_before = engine.get_metrics()["prefix_cache_hit_tokens"]
    later = [Req("c", prompt + [5], 6, seed=3)]
    assert finish_after_failure(engine, runner, later) == expected(later)
    # sync: launches before the failing one wrote 16 tokens each, and those stay findable; async:
    # the launch in flight when the next one fails is given up with it
    written = 0 if async_scheduling else 16 * (fail_at - 1)
    assert engine.get_metrics()["prefix_cache_hit_tokens"] - hits_before == written


def test_blocks_of_a_step_whose_result_fails_are_not_findable():
    """Async: launch 1 runs (the fake writes its KV at launch), launch 2 is scheduled on top, then
    launch 1's result raises. Both steps count as never run: nothing they registered stays."""
    prompt = list(range(40))
    engine, runner = make_engine(block_size=4, budget=16, async_scheduling=True, fail_result_at=[1])
    engine.add_request("a", prompt, Req("a", prompt, 5).params())
    engine.step()  # launch 1
    with pytest.raises(ExecutorFailure):
        engine.step()  # launch 2, then launch 1's result
    later = [Req("c", prompt + [5], 6, seed=3)]
    done = finish_after_failure(engine, runner, later)
    assert done == expected(later)
    assert engine.get_metrics()["prefix_cache_hit_tokens"] == 0


@pytest.mark.parametrize("lost", [2, 3])
def test_a_lost_decode_step_leaves_no_block_it_completes(lost):
    """Async decode: the block that a placeholder token completes is registered when the token's
    id arrives, while the step writing its KV is in flight. When that step's result is lost, the
    block must go with it: a later request with the same tokens may not hit it."""
    prompt = list(range(7 if lost == 2 else 6))  # position 7 is written by launch `lost`
    engine, runner = make_engine(block_size=4, async_scheduling=True, fail_result_at=[lost])
    engine.add_request("a", prompt, Req("a", prompt, 5).params())
    with pytest.raises(ExecutorFailure):
        for _ in range(lost + 1):
            engine.step()
    head = (prompt + reference_generate(prompt, 2))[:8]
    later = [Req("c", head + [5], 6, seed=3)]
    hits_before = engine.get_metrics()["prefix_cache_hit_tokens"]
    assert finish_after_failure(engine, runner, later) == expected(later)
    assert engine.get_metrics()["prefix_cache_hit_tokens"] - hits_before == 4  # block 0 only


# ---- statistics ---------------------------------------------------------------------------------
@SYNC_ASYNC
def test_preemption_does_not_inflate_hit_statistics(async_scheduling):
    reqs = burst(6, k=6, shared_len=20, n=3, max_tokens=14)
    results, engine, runner = run(reqs, block_size=4, num_kv_blocks=40, budget=32, async_scheduling=async_scheduling)
    assert results == expected(reqs)
    m = engine.get_metrics()
    cached = [runner.final_outputs[r.rid].num_cached_tokens for r in reqs]
    assert m["prefix_cache_hit_tokens"] == sum(cached) and max(cached) <= 20  # each its first admission's
    assert m["num_preemptions"] > 0 and m["prefix_cache_preempted_requests"] > 0
    assert m["prefix_cache_requests"] == len(reqs)  # first admissions: one per request (children fork)
    assert m["prefix_cache_query_tokens"] == sum(len(r.prompt) for r in reqs)
    assert m["prefix_cache_hit_tokens"] <= 5 * 20
    assert m["prefix_cache_preempted_hit_tokens"] > 0
