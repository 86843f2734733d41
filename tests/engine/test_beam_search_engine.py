"""Beam search's KV plumbing, over the shadow-KV fake runner: beams are forked where the search
chooses one twice (copy-on-write when they split inside a block) and freed where it drops one;
every beam must read back exactly its own history, since the fake's top-k is a function of what
it reads. The reference runs the same search (engine/beam_search.py, checked against HF in
tests/model/test_beam_search.py) on top-k computed from the token lists directly, with no KV."""

from __future__ import annotations

import pytest

from pagedllm.engine.beam_search import BeamSearch
from pagedllm.engine.config import SchedulerConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.sampling_params import SamplingParams
from tests.engine.fake_runner import fake_logprobs, next_token
from tests.engine.sharing_harness import CheckedRunner, check_state

EOS = 5


def beam_params(width: int, max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(n=width, use_beam_search=True, temperature=0, max_tokens=max_tokens, **kw)


def reference(prompt: list[int], params: SamplingParams, eos: frozenset[int]) -> list[tuple[list[int], float]]:
    search = BeamSearch("ref", params, eos)
    beams = [list(prompt)]
    while True:
        topk = []
        for tokens in beams:
            ctx = [(p, t) for p, t in enumerate(tokens)]
            topk.append(fake_logprobs(next_token(ctx), search.num_candidates, ctx))
        survivors = search.step([b[len(prompt) :] for b in beams], topk)
        if not survivors:
            return [(h.token_ids, h.score) for h in search.results()]
        beams = [beams[s.parent] + [s.token] for s in survivors]


def run(reqs, *, block_size, num_kv_blocks=4096, budget=8192, prefix=True, async_scheduling=False, abort=None):
    cfg = SchedulerConfig(
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_num_seqs=64,
        max_num_batched_tokens=budget,
        max_model_len=4096,
        enable_prefix_caching=prefix,
    )
    runner = CheckedRunner(block_size, num_kv_blocks=num_kv_blocks, supports_async=async_scheduling)
    engine = LLMEngine(cfg, runner, eos_token_ids={EOS}, async_scheduling=async_scheduling)
    runner.engine = engine
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        for rid in (abort or {}).get(step, []):
            engine.abort_request(rid)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        check_state(engine, runner)
        step += 1
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return done, engine


def workload():
    prompts = [[(7 * i + 3 * k) % 90 + 6 for i in range(n)] for k, n in enumerate((15, 16, 17, 4, 33))]
    params = [beam_params(w, m) for w, m in ((2, 12), (3, 9), (4, 10), (4, 14), (2, 6))]
    return [(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]


def check(done, reqs):
    for rid, prompt, params in reqs:
        want = reference(prompt, params, frozenset({EOS}))
        got = [(c.token_ids, c.score) for c in done[rid].outputs]
        assert [g[0] for g in got] == [w[0] for w in want], rid
        assert [g[1] for g in got] == pytest.approx([w[1] for w in want]), rid


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_beams_read_their_own_history(block_size, async_scheduling):
    reqs = workload()
    done, engine = run(reqs, block_size=block_size, async_scheduling=async_scheduling)
    check(done, reqs)
    m = engine.get_metrics()
    assert m["num_forked_sequences"] > 0
    if block_size > 1:
        assert m["num_copy_on_write_blocks"] > 0  # beams split inside a block


@pytest.mark.parametrize(
    "kw",
    [{"prefix": False}, {"budget": 7}, {"num_kv_blocks": 40}, {"num_kv_blocks": 40, "async_scheduling": True}],
    ids=["no-prefix-cache", "chunked", "preemption", "preemption-async"],
)
def test_scheduling_never_changes_the_beams(kw):
    reqs = workload()
    done, engine = run(reqs, block_size=4, **kw)
    check(done, reqs)
    if kw.get("num_kv_blocks"):
        assert engine.get_metrics()["num_preemptions"] > 0


def test_beams_beside_sampled_requests_and_an_abort():
    """An aborted search frees every block of every beam at once (check_state, after that step:
    every held block belongs to a live sequence's table); the others are unchanged."""
    reqs = workload()
    sampled = ("s", [9, 9, 9, 9, 9], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=7, ignore_eos=True))
    done, _ = run([*reqs, sampled], block_size=4, abort={4: ["r2"]})
    check(done, [r for r in reqs if r[0] != "r2"])
    assert "r2" not in done and len(done["s"].outputs) == 2
