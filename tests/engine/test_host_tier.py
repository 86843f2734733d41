"""The host tier over the shadow-KV runner: outputs equal the reference (the tier on or off, any
pool), hits really come from host memory (tiny GPU pools evict what later requests need), every
loaded block holds exactly its tokens' KV (ShadowRunner._check_loads), both tiers keep their
invariants after every step, and everything is free (or cached) at the end."""

import pytest

from pagedllm.engine import LLMEngine, SamplingParams, SchedulerConfig
from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.host_tier import HostBlock
from tests.engine.fake_runner import ShadowRunner, reference_generate
from tests.engine.test_engine_equivalence import check_registered_blocks_hold_their_kv, make_workload


def check_host_blocks_hold_their_kv(engine, runner):
    """A findable host block holds its tokens' KV once the step that offloads it has run."""
    host = engine.kv.host
    bs = engine.kv.block_size
    for b in host.pool.blocks:
        if b.token_ids is not None:
            got = [runner.host_shadow.get(b.block_id * bs + j) for j in range(bs)]
            assert [w and w[-1] for w in got] == list(b.token_ids), (b, got)


def run(reqs, *, host_blocks, blocks, block_size=4, budget=32, max_num_seqs=4, mode="recompute", windows=None):
    """Requests arrive two per step (rid, prompt, max_tokens); returns (outputs, engine, runner)."""
    cfg = SchedulerConfig(
        num_kv_blocks=blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=256,
        num_host_kv_blocks=host_blocks,
        preemption_mode=mode,
    )
    runner = ShadowRunner(block_size, windows=windows)
    engine = LLMEngine(cfg, runner)
    pending, results = list(reqs), {}
    while pending or engine.has_unfinished_requests():
        for _ in range(2):
            if pending:
                rid, prompt, max_tokens = pending.pop(0)
                engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        engine.kv.check_invariants()
        if windows is None:
            check_registered_blocks_hold_their_kv(engine, runner)
        if engine.kv.host is not None:
            check_host_blocks_hold_their_kv(engine, runner)
    kv = engine.kv
    assert kv.num_free_blocks == kv.num_blocks
    if kv.host is not None:
        assert all(b.ref_cnt == 0 for b in kv.host.pool.blocks) and not kv.host.swapped
    return results, engine, runner


def revisiting(n_prefixes=6, turns=3, prefix_len=24, seed=0):
    """Conversations behind distinct system prompts, each coming back after the others passed:
    with a GPU pool smaller than all prefixes, the second turn finds its prefix only on the host."""
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(97) for _ in range(prefix_len)] for _ in range(n_prefixes)]
    history = [list(p) for p in prefixes]
    reqs = []
    for t in range(turns):
        for i in range(n_prefixes):
            history[i] += [rng.randrange(97) for _ in range(3)]
            reqs.append((f"c{i}t{t}", list(history[i]), 4))
    return reqs


def expected(reqs, windows=None):
    return {rid: reference_generate(p, m, windows=windows) for rid, p, m in reqs}


@pytest.mark.parametrize("host_blocks", [0, 8, 64, 1000])
def test_outputs_equal_the_reference_with_hits_from_host(host_blocks):
    reqs = revisiting()
    results, engine, runner = run(reqs, host_blocks=host_blocks, blocks=24)
    assert results == expected(reqs)
    m = engine.get_metrics()
    assert m["num_host_kv_blocks"] == host_blocks
    if host_blocks >= 64:  # the tier holds the working set: the revisits hit it
        assert m["prefix_cache_host_hit_tokens"] > 0 and runner.num_loaded_blocks + runner.num_prefetched_blocks > 0
        assert m["num_loaded_blocks"] == runner.num_loaded_blocks + runner.num_prefetched_blocks
        assert (
            m["prefix_cache_hit_tokens"]
            > run(reqs, host_blocks=0, blocks=24)[1].get_metrics()["prefix_cache_hit_tokens"]
        )
    if host_blocks == 0:
        assert m["prefix_cache_host_hit_tokens"] == 0 and m["num_offloaded_blocks"] == 0


@pytest.mark.parametrize("seed", range(3))
def test_random_workloads_tiny_pools(seed):
    reqs = make_workload(seed + 20, n=14)
    results, engine, _ = run(reqs, host_blocks=10, blocks=26, budget=16)
    assert results == expected(reqs)
    assert engine.get_metrics()["num_offloaded_blocks"] > 0


def test_sliding_window_groups_hit_through_the_host():
    windows = (None, 8)
    reqs = revisiting(n_prefixes=5, turns=2)
    results, engine, runner = run(reqs, host_blocks=200, blocks=40, windows=windows)
    assert results == expected(reqs, windows)
    assert engine.get_metrics()["prefix_cache_host_hit_tokens"] > 0


def test_blocks_that_left_the_window_are_not_offloaded():
    """One window group: a long sequence gives back its early blocks while it runs; a tiny pool
    evicts them; only blocks still in a window when their sequence ended reach the host."""
    windows = (8,)
    reqs = [("a", list(range(40)), 30), ("b", list(range(50, 90)), 2), ("c", list(range(10, 50)), 2)]
    results, engine, _ = run(reqs, host_blocks=100, blocks=10, budget=8, max_num_seqs=1, windows=windows)
    assert results == expected(reqs, windows)
    m = engine.get_metrics()
    assert m["num_offloaded_blocks"] > 0
    cached = {b.token_ids for b in engine.kv.host.pool.blocks if b.token_ids is not None}
    assert tuple(range(4)) not in cached and tuple(range(12, 16)) not in cached  # left "a"'s window early


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_modes_give_the_reference(mode):
    reqs = make_workload(3, n=10)
    results, engine, _ = run(reqs, host_blocks=64, blocks=96 // 4 + 2, budget=32, mode=mode)
    assert results == expected(reqs)
    m = engine.get_metrics()
    assert m["num_preemptions"] > 0 and m["num_resumed_sequences"] > 0
    if mode == "swap":
        assert m["num_swapped_out_sequences"] > 0 and m["num_swapped_out_blocks"] > 0
        assert m["prefix_cache_preempted_host_hit_tokens"] > 0
    else:
        assert m["num_swapped_out_sequences"] == 0


def test_trace_names_offload_load_and_host_evict():
    reqs = revisiting(n_prefixes=8, turns=2)
    reqs = reqs[:8] + reqs[8:][::-1]  # the second turns newest first: the host holds those, not the oldest
    sink: list = []
    cfg = SchedulerConfig(
        num_kv_blocks=24,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=256,
        num_host_kv_blocks=24,
        trace_blocks=True,
    )
    engine = LLMEngine(cfg, ShadowRunner(4), trace_sink=sink)
    for rid, p, m in reqs:
        engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    kinds = {e["event"] for e in sink}
    assert {"OFFLOAD", "LOAD", "HOST_EVICT"} <= kinds
    assert all("host_block_id" in e for e in sink if e["event"] in ("OFFLOAD", "LOAD"))


def test_a_step_that_never_runs_gives_back_its_offloads_and_loads():
    """Offloads and loads registered for a step that raises are uncached: no later load reads a
    host block whose copy never ran (the shadow runner would see the wrong KV)."""
    reqs = revisiting()

    class Failing(ShadowRunner):
        def execute(self, out):
            if out.blocks_to_offload and out.blocks_to_load and not getattr(self, "failed", False):
                self.failed = True
                raise RuntimeError("device lost")
            return super().execute(out)

    cfg = SchedulerConfig(
        num_kv_blocks=24,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=256,
        num_host_kv_blocks=64,
    )
    runner = Failing(4)
    engine = LLMEngine(cfg, runner)
    for rid, p, m in reqs:
        engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    failed_ids = []
    while engine.has_unfinished_requests():
        try:
            engine.step()
        except RuntimeError:
            failed_ids = engine.core.request_ids()
            for rid in failed_ids:
                engine.abort_request(rid)
        engine.kv.check_invariants()
        check_host_blocks_hold_their_kv(engine, runner)
    assert runner.failed and failed_ids
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_host_blocks_are_host_blocks_and_stats_add_up():
    reqs = revisiting()
    _, engine, _ = run(reqs, host_blocks=64, blocks=24)
    host = engine.kv.host
    assert all(isinstance(b, HostBlock) for b in host.pool.blocks)
    m = engine.get_metrics()
    assert m["prefix_cache_gpu_hit_tokens"] + m["prefix_cache_host_hit_tokens"] == m["prefix_cache_hit_tokens"]
    assert m["num_cached_host_kv_blocks"] == host.num_cached_blocks > 0


def test_config_refuses_swap_without_a_tier_and_negative_sizes():
    with pytest.raises(InvalidRequestError) as e:
        SchedulerConfig(num_kv_blocks=8, preemption_mode="swap")
    assert e.value.param == "preemption_mode"
    with pytest.raises(InvalidRequestError) as e:
        SchedulerConfig(num_kv_blocks=8, preemption_mode="swapp", num_host_kv_blocks=4)
    assert e.value.param == "preemption_mode"
    with pytest.raises(InvalidRequestError) as e:
        SchedulerConfig(num_kv_blocks=8, num_host_kv_blocks=-1)
    assert e.value.param == "num_host_kv_blocks"


def test_loads_of_waiting_requests_are_prefetched_beside_the_step():
    """All requests arrive at once behind a small token budget: those left waiting when the budget
    runs out, whose prefix is on the host, are admitted with no token to compute and their loads
    queued as the step's prefetch. The shadow runner lands a prefetch only after the step's forward
    (a read in the same step would see old KV) and checks each prefetched block when it is first
    read; the outputs still equal the reference."""
    reqs = revisiting(n_prefixes=6, turns=3)
    cfg = SchedulerConfig(
        num_kv_blocks=40, block_size=4, max_num_seqs=8, max_num_batched_tokens=12, max_model_len=256,
        num_host_kv_blocks=200,
    )  # fmt: skip
    runner = ShadowRunner(4)
    engine = LLMEngine(cfg, runner)
    results, turn = {}, 0
    while turn < 3 or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():  # a turn: every conversation at once
            for rid, p, m in reqs[turn * 6 : (turn + 1) * 6]:
                engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
            turn += 1
        for o in engine.step():
            if o.finished:
                results[o.request_id] = o.outputs[0].token_ids
        engine.kv.check_invariants()
        check_host_blocks_hold_their_kv(engine, runner)
    assert results == expected(reqs)
    assert runner.num_prefetched_blocks > 0
    assert engine.get_metrics()["prefix_cache_host_hit_tokens"] > 0


def test_a_request_with_a_host_hit_waits_alone_while_others_decode():
    """A request whose prefix is only in the host tier, arriving while another decodes: the step
    that admits it runs the decode and queues its loads as a prefetch (nothing of that step waits
    for them); it computes from the next step on, and its output equals the reference. A second
    request with the same prefix in the same step hits the blocks being prefetched: it waits too
    (the shadow runner fails a step that holds a block it prefetches)."""
    import random

    rng = random.Random(3)
    prefix = [rng.randrange(97) for _ in range(32)]
    filler = [[rng.randrange(97) for _ in range(32)] for _ in range(4)]
    decoder = [rng.randrange(97) for _ in range(8)]
    outs = []

    class Recording(ShadowRunner):
        def execute(self, out):
            outs.append((out, [s.seq.request_id for s in out.scheduled]))
            return super().execute(out)

    cfg = SchedulerConfig(
        num_kv_blocks=24, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
        num_host_kv_blocks=64,
    )  # fmt: skip
    runner = Recording(4)
    engine = LLMEngine(cfg, runner)
    greedy = dict(temperature=0, ignore_eos=True)
    for rid, p in [("first", prefix + [1]), *((f"f{i}", f) for i, f in enumerate(filler))]:
        engine.add_request(rid, p, SamplingParams(max_tokens=2, **greedy))
        while engine.has_unfinished_requests():  # one at a time: the filler evicts the prefix to the host
            engine.step()
    engine.add_request("decoder", decoder, SamplingParams(max_tokens=12, **greedy))
    engine.step()
    engine.step()
    outs.clear()
    engine.add_request("again", prefix + [2, 3], SamplingParams(max_tokens=3, **greedy))
    # the same prefix, admitted in the same step: it hits the GPU blocks being prefetched, so it waits too
    engine.add_request("twin", prefix + [4, 5], SamplingParams(max_tokens=3, **greedy))
    results = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                results[o.request_id] = o.outputs[0].token_ids
    admitted = next(i for i, (out, _) in enumerate(outs) if out.blocks_to_prefetch)
    out, scheduled = outs[admitted]
    assert "decoder" in scheduled and "again" not in scheduled and "twin" not in scheduled
    assert not out.blocks_to_load
    assert {"again", "twin"} <= set(outs[admitted + 1][1])
    assert results["again"] == reference_generate(prefix + [2, 3], 3)
    assert results["twin"] == reference_generate(prefix + [4, 5], 3)
    assert engine.get_metrics()["num_prefetched_blocks"] == len(out.blocks_to_prefetch) > 0
