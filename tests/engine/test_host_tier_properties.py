"""Property test of both tiers: random workloads (shared prefixes, revisits, aborts) over tiny GPU
pools and tiny host tiers, either preemption mode, any block size, with or without a window
group. After every step both pools keep their invariants (block_pool.py, host_tier.py), every
findable block of either tier holds its tokens' KV, loads are checked by the shadow runner; at
the end every GPU block is free, every host block free or cached, and outputs equal the reference."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.engine import LLMEngine, SamplingParams, SchedulerConfig
from tests.engine.fake_runner import ShadowRunner, reference_generate
from tests.engine.test_host_tier import check_host_blocks_hold_their_kv

STEMS = [[(7 * i + j) % 97 for j in range(30)] for i in range(4)]  # system prompts the requests share

request = st.tuples(
    st.integers(0, len(STEMS) - 1),  # which system prompt
    st.integers(0, 30),  # how much of it
    st.lists(st.integers(0, 96), min_size=1, max_size=8),  # the request's own tokens
    st.integers(1, 6),  # max_tokens
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request, min_size=1, max_size=12),
    block_size=st.sampled_from([2, 4, 8]),
    spare_blocks=st.integers(0, 6),
    host_blocks=st.integers(1, 24),
    swap=st.booleans(),
    window=st.sampled_from([None, 6]),
    abort_at=st.integers(0, 30),
)
def test_both_tiers_keep_their_invariants(reqs, block_size, spare_blocks, host_blocks, swap, window, abort_at):
    windows = None if window is None else (None, window)
    prompts = [(f"r{i}", STEMS[s][:n] + own, m) for i, (s, n, own, m) in enumerate(reqs)]
    longest = max(len(p) + m for _, p, m in prompts)
    per_seq = -(-longest // block_size) * (1 if windows is None else 2)
    cfg = SchedulerConfig(
        num_kv_blocks=per_seq + spare_blocks,
        block_size=block_size,
        max_num_seqs=3,
        max_num_batched_tokens=16,
        max_model_len=128,
        num_host_kv_blocks=host_blocks,
        preemption_mode="swap" if swap else "recompute",
    )
    runner = ShadowRunner(block_size, windows=windows)
    engine = LLMEngine(cfg, runner)
    pending, results, aborted = list(prompts), {}, set()
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending:
            rid, prompt, m = pending.pop(0)
            engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        if step == abort_at and engine.core.request_ids():
            rid = engine.core.request_ids()[0]
            engine.abort_request(rid)
            aborted.add(rid)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        engine.kv.check_invariants()
        check_host_blocks_hold_their_kv(engine, runner)
        step += 1
    kv = engine.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.host.pool.blocks) and not kv.host.swapped
    want = {rid: reference_generate(p, m, windows=windows) for rid, p, m in prompts if rid not in aborted}
    assert {r: t for r, t in results.items() if r not in aborted} == want
