"""Prefix-cache statistics that tell the truth under preemption: a resumed sequence re-hits the
blocks it computed itself, so its lookups are counted apart (vLLM v1's preempted_* counters)
and its num_cached_tokens stays what its first admission found."""

import pytest

from pagedllm.engine import LLMEngine, SamplingParams, SchedulerConfig
from tests.engine.fake_runner import ShadowRunner, drain, reference_generate
from tests.engine.test_engine_equivalence import make_workload


def run_preempting(reqs, block_size, num_kv_blocks, async_scheduling=False):
    cfg = SchedulerConfig(
        num_kv_blocks=num_kv_blocks, block_size=block_size, max_num_batched_tokens=32, max_model_len=256
    )
    engine = LLMEngine(cfg, ShadowRunner(block_size), async_scheduling=async_scheduling)
    for rid, prompt, max_tokens in reqs:
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return engine, drain(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("block_size", [4, 8])
def test_resumed_lookups_are_counted_apart(block_size, async_scheduling):
    reqs = make_workload(3, n=10)
    engine, done = run_preempting(reqs, block_size, 96 // block_size + 2, async_scheduling)
    m = engine.get_metrics()
    assert m["num_preemptions"] > 0 and m["prefix_cache_preempted_hit_tokens"] > 0  # victims re-hit themselves
    for rid, prompt, max_tokens in reqs:
        out = done[rid]
        assert out.outputs[0].token_ids == reference_generate(prompt, max_tokens)
        assert 0 <= out.num_cached_tokens < len(prompt), (rid, out.num_cached_tokens, len(prompt))
    # the main counters are the first admissions' lookups, and nothing else
    assert m["prefix_cache_requests"] == len(reqs)
    assert m["prefix_cache_query_tokens"] == sum(len(p) for _, p, _ in reqs)
    assert m["prefix_cache_hit_tokens"] == sum(out.num_cached_tokens for out in done.values())
    assert m["prefix_cache_hit_rate"] == m["prefix_cache_hit_tokens"] / m["prefix_cache_query_tokens"]
    # at most one resume per preemption (async: a victim can finish while it waits), each looking
    # up its whole sequence
    assert 0 < m["prefix_cache_preempted_requests"] <= m["num_preemptions"]
    assert m["prefix_cache_preempted_query_tokens"] > m["prefix_cache_preempted_hit_tokens"]


def test_the_readme_figures():
    """The README's "Statistics" paragraph: 10 requests, 26 blocks of 4 tokens, sync scheduling.
    First admissions hit 56 of 293 prompt tokens (19.1%); counting the resumes' lookups in the
    main counters too, as before, would report 216 of 521 (41.5%)."""
    engine, _ = run_preempting(make_workload(3, n=10), 4, 26)
    m = engine.get_metrics()
    assert m["num_preemptions"] == 6
    assert (m["prefix_cache_hit_tokens"], m["prefix_cache_query_tokens"]) == (56, 293)
    old_hits = m["prefix_cache_hit_tokens"] + m["prefix_cache_preempted_hit_tokens"]
    old_queries = m["prefix_cache_query_tokens"] + m["prefix_cache_preempted_query_tokens"]
    assert (old_hits, old_queries) == (216, 521)


def test_a_preempted_prompt_keeps_its_first_admission_hit():
    """A 10-token prompt decoding into a pool too small for two sequences: it is preempted after
    writing several blocks, and on resume re-hits them; num_cached_tokens stays 0."""
    engine, done = run_preempting([("a", list(range(10)), 20), ("b", list(range(50, 60)), 20)], 4, 9)
    assert engine.get_metrics()["num_preemptions"] > 0
    m = engine.get_metrics()
    assert [done[r].num_cached_tokens for r in "ab"] == [0, 0]
    assert (m["prefix_cache_query_tokens"], m["prefix_cache_hit_tokens"]) == (20, 0)
    assert m["prefix_cache_preempted_hit_tokens"] > 0


def test_no_counting_without_prefix_caching():
    cfg = SchedulerConfig(num_kv_blocks=11, block_size=4, max_model_len=64, enable_prefix_caching=False)
    engine = LLMEngine(cfg, ShadowRunner(4))
    for rid in "ab":
        engine.add_request(rid, list(range(10)), SamplingParams(max_tokens=20, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    m = engine.get_metrics()
    assert m["num_preemptions"] > 0
    counters = {k: v for k, v in m.items() if k.startswith("prefix_cache_")}
    assert len(counters) == 10 and set(counters.values()) == {0}  # 3 of them: the host tier's
