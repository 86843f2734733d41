"""Parallel sampling by fork, through LLMEngine and the shadow-KV runner: a request with n > 1
computes its prompt once, its children share the prompt's blocks and copy the partly filled last
block on their first write into it; every child's tokens equal those of an independent n=1 run
with its seed (seed + i), whatever else runs beside it, and no shared block is written in place."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.sharing_harness import Req, run


def prompt_of(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(97) for _ in range(length)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_children_equal_independent_runs_around_block_boundaries(block_size, delta, async_scheduling):
    rng = random.Random(block_size * 10 + delta)
    length = 3 * block_size + delta if block_size > 1 else 7 + delta
    prompt = prompt_of(rng, length)
    reqs = [Req("fork", prompt, 12, n=6, seed=100)]
    results, engine, runner = run(reqs, block_size=block_size, async_scheduling=async_scheduling)
    assert results["fork"] == reqs[0].expected()
    assert len({tuple(t) for t in results["fork"]}) == 6  # the children really diverge
    m = engine.get_metrics()
    assert m["num_forked_sequences"] == 5
    # the prompt is computed once; the five sharers of a partial last block copy it, the last writer keeps it
    assert runner.executed_prompt_tokens == length
    assert m["num_copy_on_write_blocks"] == (5 if length % block_size else 0)
    assert m["prefix_cache_requests"] == 1 and m["num_prompt_tokens"] == length


def test_n_independent_requests_give_the_same_tokens():
    """The reference is right: n=1 requests with seeds seed + i give what the fork gives."""
    prompt = prompt_of(random.Random(3), 21)
    forked, _, _ = run([Req("f", prompt, 9, n=4, seed=5)], block_size=4)
    alone, _, _ = run([Req(f"a{i}", prompt, 9, seed=5 + i) for i in range(4)], block_size=4, prefix=False)
    assert forked["f"] == [alone[f"a{i}"][0] for i in range(4)]


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 4, 16]))
    rng = random.Random(draw(st.integers(0, 2**16)))
    shared = prompt_of(rng, 3 * bs + 2)
    reqs = []
    for i in range(draw(st.integers(1, 5))):
        k = draw(st.integers(0, 3))
        length = max(1, k * bs + draw(st.sampled_from([-1, 0, 1])))
        if draw(st.booleans()):  # shares a prefix with the others
            prompt = shared[: min(length, len(shared))] + prompt_of(rng, max(0, length - len(shared)))
        else:
            prompt = prompt_of(rng, length)
        n = draw(st.integers(1, 8))
        seed = draw(st.integers(0, 1000)) if n > 1 or draw(st.booleans()) else None
        reqs.append(Req(f"r{i}", prompt, draw(st.integers(1, 10)), n=n, seed=seed))
    budget = draw(st.sampled_from([3, 8, 32, 8192]))
    per_step = draw(st.sampled_from([None, 1, 2]))
    need = sum(r.n * (-(-(len(r.prompt) + r.max_tokens) // bs)) for r in reqs)
    largest = max(r.n * (-(-(len(r.prompt) + r.max_tokens) // bs)) for r in reqs)
    blocks = draw(st.sampled_from([need + 8, max(largest + 2, need // 2)]))  # plenty, or tight (preemption)
    return reqs, dict(block_size=bs, budget=budget, num_kv_blocks=blocks, max_num_seqs=64), per_step


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.booleans(), st.booleans())
def test_forks_mixed_with_other_requests_property(workload, async_scheduling, prefix):
    reqs, kw, per_step = workload
    results, engine, _ = run(reqs, per_step=per_step, async_scheduling=async_scheduling, prefix=prefix, **kw)
    assert results == {r.rid: r.expected() for r in reqs}
    m = engine.get_metrics()
    assert m["num_forked_sequences"] == sum(r.n - 1 for r in reqs)  # a group forks once, preempted or not


def test_copy_on_write_is_what_keeps_children_apart():
    """The in-place check can fail: with copy-on-write disabled the second child's write lands in
    the first child's block and the harness reports it."""
    from pagedllm.engine.single_type_kv_cache_manager import FullAttentionManager

    orig = FullAttentionManager.needs_copy_on_write
    FullAttentionManager.needs_copy_on_write = lambda self, seq, n: False  # type: ignore[method-assign]
    try:
        with pytest.raises(AssertionError, match="written in place"):
            run([Req("f", list(range(10)), 4, n=3, seed=1)], block_size=4)
    finally:
        FullAttentionManager.needs_copy_on_write = orig  # type: ignore[method-assign]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_a_group_midway_frees_everything(async_scheduling):
    rng = random.Random(9)
    reqs = [Req("f", prompt_of(rng, 13), 20, n=5, seed=3), Req("g", prompt_of(rng, 9), 15, n=3, seed=40)]
    reqs.append(Req("h", reqs[0].prompt[:8] + prompt_of(rng, 5), 12))
    results, engine, _ = run(reqs, block_size=4, abort={4: ["f"]}, async_scheduling=async_scheduling)
    assert "f" not in results
    assert results == {r.rid: r.expected() for r in reqs[1:]}


@pytest.mark.parametrize("abort_step", [0, 1, 2])
def test_abort_before_the_fork(abort_step):
    """Aborted while its prompt is still being prefilled (chunks of 4): the children were never
    forked and hold nothing."""
    reqs = [Req("f", list(range(30)), 5, n=4, seed=1), Req("o", list(range(50, 60)), 6, seed=2)]
    results, engine, _ = run(reqs, block_size=4, budget=4, abort={abort_step: ["f"]})
    assert results == {"o": reqs[1].expected()}
    assert engine.get_metrics()["num_forked_sequences"] == 0
