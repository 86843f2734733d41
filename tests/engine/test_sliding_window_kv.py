"""KV-cache groups with sliding windows, over the shadow-KV runner: the tokens are the reference's
(each group reads back exactly its window) under every block size, token budget, pool size,
prefix-caching setting and scheduling mode; a window's blocks stay bounded; a windowed prefix
hit equals a miss; free == total at the end."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.engine import LLMEngine, SamplingParams, SchedulerConfig
from pagedllm.engine.kv_cache_groups import blocks_per_sequence
from pagedllm.engine.single_type_kv_cache_manager import NULL_BLOCK
from tests.engine.fake_runner import ShadowRunner, drain, reference_generate

GREEDY = dict(temperature=0, ignore_eos=True)


def engine_for(windows, block_size, blocks, budget=64, prefix=True, async_scheduling=False, max_model_len=256, **kw):
    cfg = SchedulerConfig(
        num_kv_blocks=blocks,
        block_size=block_size,
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_prefix_caching=prefix,
        **kw,
    )
    runner = ShadowRunner(block_size, windows=windows)
    return LLMEngine(cfg, runner, async_scheduling=async_scheduling), runner


def held_by_window(engine, seq) -> list[int]:
    """Blocks a sequence holds in each sliding-window group."""
    return [
        sum(1 for b in seq.block_tables[g] if b != NULL_BLOCK)
        for g, group in enumerate(engine.kv.groups)
        if group.sliding_window is not None and len(seq.block_tables) > g
    ]


def check_step(engine, runner, budget):
    kv = engine.kv
    kv.check_invariants()
    bs = kv.block_size
    for b in kv.pool.blocks:  # a findable block holds its own group's KV of its tokens
        if b.token_ids is not None:
            for j, tok in enumerate(b.token_ids):
                g, pos, written = runner.shadow[b.block_id * bs + j]
                assert (g, pos % bs, written) == (b.group, j, tok), b
    for seq in engine.scheduler.running:
        tables = seq.block_tables
        assert len({len(t) for t in tables}) == 1, seq  # one length: an allocation covers every group
        for group in kv.groups:  # groups of one window empty the same entries
            same = [h for h, other in enumerate(kv.groups) if other.sliding_window == group.sliding_window]
            assert len({tuple(b == NULL_BLOCK for b in tables[h]) for h in same}) == 1, seq
        for group, held in zip(
            [g for g in kv.groups if g.sliding_window is not None], held_by_window(engine, seq), strict=True
        ):
            w = group.sliding_window
            assert held <= -(-(w - 1) // bs) + 1 + -(-budget // bs), (seq, held)


WINDOW_SETS = [(8,), (None, 8), (None, 5, 20), (3,), (17, None), (None, 8, 8, 5), (6, 6)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, 10**6),
    st.sampled_from(WINDOW_SETS),
    st.sampled_from([4, 8]),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from([7, 64]),
)
def test_windowed_groups_give_the_reference_tokens(seed, windows, block_size, prefix, async_scheduling, tight, budget):
    rng = random.Random(seed)
    shared = [rng.randrange(97) for _ in range(60)]
    reqs = []
    for i in range(8):
        own = [rng.randrange(97) for _ in range(rng.randrange(1, 40))]
        prompt = shared[: rng.randrange(0, 61)] + own if i % 2 else own
        reqs.append((f"r{i}", prompt, rng.randrange(1, 40)))
    engine, runner = engine_for(windows, block_size, 1, budget)  # sizes only: the real pool below
    one = max(
        blocks_per_sequence(engine.kv.groups, len(p) + n, block_size, budget) for _, p, n in reqs
    )  # a lone sequence always fits; `tight` makes the others preempt
    blocks = one + (2 if tight else 200)
    engine, runner = engine_for(windows, block_size, blocks, budget, prefix, async_scheduling)
    results = {}
    pending = list(reqs)
    while pending or engine.has_unfinished_requests():
        for _ in range(2):  # arrivals trickle in
            if pending:
                rid, prompt, n = pending.pop(0)
                engine.add_request(rid, prompt, SamplingParams(max_tokens=n, **GREEDY))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        check_step(engine, runner, budget)
    assert results == {rid: reference_generate(p, n, windows=windows) for rid, p, n in reqs}
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_long_generation_holds_a_bounded_window():
    """1,000 tokens with window 64 and blocks of 16: the window's group never holds more than
    ceil(64 / 16) + 1 blocks, while the full-attention group grows with the sequence."""
    for async_scheduling in (False, True):
        engine, _ = engine_for((None, 64), 16, 200, async_scheduling=async_scheduling, max_model_len=1100)
        prompt = list(range(10))
        engine.add_request("long", prompt, SamplingParams(max_tokens=1000, **GREEDY))
        most = [0, 0]
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            groups = engine.get_metrics()["kv_cache_groups"]  # what /metrics exports per group
            assert [(g["kind"], g["sliding_window"]) for g in groups] == [
                ("full_attention", None),
                ("sliding_window", 64),
            ]
            most = [max(a, g["num_blocks"]) for a, g in zip(most, groups, strict=True)]
        assert most[1] <= 64 // 16 + 1
        # between steps: the step that computes position 1008 samples the last token and frees all
        # (async: one step later, so that step's blocks are seen)
        assert most[0] == -(-(1008 + async_scheduling) // 16)
        assert done["long"].outputs[0].token_ids == reference_generate(prompt, 1000, windows=(None, 64))
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_windowed_prefix_hit_equals_a_miss():
    """A prompt computed by an earlier request is hit, in a window group only the blocks its window
    reads (the earlier ones were given back), and gives the tokens of a cold run."""
    for windows in ((8,), (None, 8)):
        engine, _ = engine_for(windows, 4, 64)
        prompt = [random.Random(1).randrange(97) for _ in range(50)]
        engine.add_request("a", prompt, SamplingParams(max_tokens=20, **GREEDY))
        drain(engine)
        engine.add_request("b", prompt + [5, 6], SamplingParams(max_tokens=20, **GREEDY))
        out = drain(engine)["b"]
        assert out.num_cached_tokens == 48  # (52 - 1) // 4 blocks
        assert out.outputs[0].token_ids == reference_generate(prompt + [5, 6], 20, windows=windows)
        cold, _ = engine_for(windows, 4, 64, prefix=False)
        cold.add_request("b", prompt + [5, 6], SamplingParams(max_tokens=20, **GREEDY))
        assert drain(cold)["b"].outputs[0].token_ids == out.outputs[0].token_ids
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_window_hit_needs_the_blocks_its_window_reads():
    """When the blocks a window reads are evicted, the window group has no hit there, and the full
    group's hit is cut to where both agree."""
    engine, _ = engine_for((None, 8), 4, 64)
    kv = engine.kv
    prompt = list(range(1, 41))
    engine.add_request("a", prompt, SamplingParams(max_tokens=1, **GREEDY))
    drain(engine)
    for b in kv.pool.blocks:  # evict the window group's copies of blocks 6 and 7 (tokens 24..31)
        if b.group == 1 and b.token_ids in (tuple(prompt[24:28]), tuple(prompt[28:32])):
            kv.pool.unregister(b)
    engine.add_request("b", prompt[:33], SamplingParams(max_tokens=3, **GREEDY))
    out = drain(engine)["b"]
    # a hit of 8 blocks (32 tokens) needs blocks 6, 7 in the window group; 6 blocks need 4 and 5
    assert out.num_cached_tokens == 24
    assert out.outputs[0].token_ids == reference_generate(prompt[:33], 3, windows=(None, 8))


def test_the_block_trace_names_the_group():
    trace: list = []
    engine, _ = engine_for((None, 8), 4, 64, trace_blocks=True)
    engine.core.kv.pool.tracer.sink = trace
    engine.add_request("a", list(range(30)), SamplingParams(max_tokens=10, **GREEDY))
    drain(engine)
    assert {e["group"] for e in trace if e["event"] == "ALLOCATE"} == {0, 1}
    released = [e for e in trace if e["event"] == "RELEASE" and e["group"] == 1]
    assert released and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_forked_samples_share_and_copy_per_group():
    """Parallel sampling on a windowed model: the children share the prompt's blocks in every group,
    copy a shared last block on write, and each equals its seed's run alone."""
    for windows, block_size in (((None, 8), 4), ((6,), 8)):
        cfg = SchedulerConfig(num_kv_blocks=80, block_size=block_size, max_num_seqs=8, max_model_len=256)
        engine = LLMEngine(cfg, ShadowRunner(block_size, salt_by_seed=True, windows=windows))
        prompt = list(range(3, 33))
        engine.add_request("f", prompt, SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=25, ignore_eos=True))
        out = drain(engine)["f"]
        got = sorted(o.token_ids for o in out.outputs)
        assert got == sorted(reference_generate(prompt, 25, seed=11 + i, windows=windows) for i in range(3))
        assert engine.get_metrics()["num_copy_on_write_blocks"] > 0
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


class RowsCheckingRunner(ShadowRunner):
    """Builds each step's inputs twice, with the block-table arrays kept across steps and afresh:
    they must agree (a table that changed without a new block_tables_version would not)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        from pagedllm.worker.step_inputs import BlockTableRows

        self.rows = BlockTableRows()
        self.checked = 0

    def execute(self, out):
        import numpy as np

        from pagedllm.worker.step_inputs import build_step_inputs

        if out.scheduled:
            kept = build_step_inputs(out, self.block_size, 97, frozenset(), self.kv_cache_groups, self.rows)
            fresh = build_step_inputs(out, self.block_size, 97, frozenset(), self.kv_cache_groups)
            pairs = [(kept.slot_mapping, fresh.slot_mapping), (kept.block_tables, fresh.block_tables)]
            pairs += [
                (a, b)
                for ka, kb in zip(kept.group_tables, fresh.group_tables, strict=True)
                for a, b in zip(ka, kb, strict=True)
            ]
            assert all(np.array_equal(a, b) for a, b in pairs)
            self.checked += 1
        return super().execute(out)


def test_block_table_arrays_kept_across_steps_follow_every_change():
    """Appends, window releases, copy-on-write of forks, preemption and resumption with hits."""
    for windows in ((None, 8, 8), (None,)):
        cfg = SchedulerConfig(
            num_kv_blocks=60, block_size=4, max_num_seqs=8, max_num_batched_tokens=24, max_model_len=256
        )
        runner = RowsCheckingRunner(4, salt_by_seed=True, windows=windows)
        engine = LLMEngine(cfg, runner, async_scheduling=True)
        rng = random.Random(3)
        shared = [rng.randrange(97) for _ in range(20)]
        for i in range(6):
            prompt = shared + [rng.randrange(97) for _ in range(rng.randrange(1, 15))]
            n = 3 if i % 2 else 1
            params = SamplingParams(n=n, seed=i, temperature=1.0, max_tokens=30, ignore_eos=True)
            engine.add_request(f"r{i}", prompt, params)
        drain(engine)
        assert runner.checked > 30 and engine.get_metrics()["num_preemptions"] > 0
        assert engine.get_metrics()["num_copy_on_write_blocks"] > 0
