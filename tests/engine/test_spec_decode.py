"""Speculative decoding in the control plane, against the shadow-KV runner: the output is the
reference output whatever the proposals, no block holding an unaccepted token is ever findable,
rejected slots are given back, and every block is free at the end."""

import json
import random

import pytest

from pagedllm.engine import LLMEngine, SamplingParams, SchedulerConfig
from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.spec_config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from pagedllm.engine.spec_decode import Backoff, NgramProposer
from pagedllm.engine.spec_verify import accepted_run
from tests.engine.fake_runner import CharTokenizer, ShadowRunner, reference_generate

PERIOD = 5


def spec(k=3, lo=1, hi=3):
    return SpeculativeConfig.parse(
        {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": lo,
            "prompt_lookup_max": hi,
            "disable_by_batch_size": None,
        }
    )


class CheckedRunner(ShadowRunner):
    """Checks, at every step's execution, that no block a proposal is written into is findable
    (the scheduler registered it already: it would be a speculative token's block)."""

    def execute(self, out):
        bs = self.block_size
        for s in out.scheduled:
            if not s.spec_token_ids:
                continue
            seq = s.seq
            first_draft = seq.num_tokens  # the position of the first proposal
            for table in seq.block_tables:
                for i in range(first_draft // bs, len(table)):
                    assert self.pool.blocks[table[i]].block_hash is None, (seq, i)
        return super().execute(out)


def make_engine(
    block_size=4,
    blocks=256,
    budget=64,
    prefix=True,
    max_num_seqs=8,
    k=3,
    max_model_len=256,
    trace=False,
    copy_period=PERIOD,
    **kw,
):
    cfg = SchedulerConfig(
        trace_blocks=trace,
        num_kv_blocks=blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_prefix_caching=prefix,
        speculative_config=None if k == 0 else spec(k),
    )
    runner = CheckedRunner(block_size, copy_period=copy_period)
    engine = LLMEngine(cfg, runner, vocab_size=97, **kw)
    runner.pool = engine.kv.pool
    return engine, runner


def check_findable_blocks_hold_accepted_kv(engine):
    """Every findable block holds, at every slot, the KV (position, token) of the tokens it is
    registered under: a block holding a rejected proposal's KV can never be found. And a running
    sequence holds no block past its computed tokens: rejected proposals' blocks went back."""
    bs = engine.kv.block_size
    for seq in engine.scheduler.running:
        assert len(seq.block_tables[0]) == -(-seq.num_computed_tokens // bs), seq
    shadow = engine.core.executor.shadow
    for b in engine.kv.pool.blocks:
        if b.token_ids is not None:
            written = [shadow.get(b.block_id * bs + j) for j in range(bs)]
            assert [w and w[1] for w in written] == list(b.token_ids), (b, written)


def prompts(seed, n=8):
    rng = random.Random(seed)
    shared = [rng.randrange(97) for _ in range(12)]
    return [(shared if i % 2 else []) + [rng.randrange(97) for _ in range(rng.randrange(2, 20))] for i in range(n)]


def run_all(engine, reqs, params, abort: tuple[int, str] | None = None):
    """Every request to the end, the invariants checked after every step; `abort` (step, request
    id): that request is aborted before that step."""
    for i, p in enumerate(reqs):
        engine.add_request(f"r{i}", p, params(i))
    done = {}
    for step in range(5000):  # a wrong rollback can stall a sequence: fail, do not hang
        if not engine.has_unfinished_requests():
            break
        if abort is not None and step == abort[0]:
            engine.abort_request(abort[1])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.kv.check_invariants()
        check_findable_blocks_hold_accepted_kv(engine)
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return done


# ---- the pieces ----------------------------------------------------------------------------
def test_ngram_proposer_takes_the_longest_then_latest_match():
    p = NgramProposer(spec(k=3, lo=1, hi=3))
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]  # latest occurrence of [1, 2, 3]
    assert p.propose([5, 6, 4, 2, 3, 7, 3], 3) == [7, 3, 7]  # only a 1-gram matches; the copy runs on periodically
    assert p.propose([4, 9, 9, 9], 3) == [9, 9, 9]  # a loop of period 1 is proposed k long
    assert p.propose([8, 1, 2, 1, 2], 3) == [1, 2, 1]  # period 2
    assert p.propose([1, 2, 3, 4], 3) == []  # no earlier occurrence
    assert p.propose([1, 2, 1, 2, 1], 2) == [2, 1]  # bounded by the caller
    assert p.propose([1, 2, 1], 0) == []
    assert NgramProposer(spec(k=3, lo=2, hi=2)).propose([7, 1, 9, 4, 1], 3) == []  # a 1-gram is too short


def test_accepted_run_is_the_matching_prefix_then_the_targets_token():
    assert accepted_run([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted, then the bonus
    assert accepted_run([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the target's token at the first mismatch
    assert accepted_run([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accepted_run([], [3]) == [3]


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"model": "", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"method": "ngram", "model": "/some/draft", "num_speculative_tokens": 2}, "speculative_config.model"),
        (
            {"model": "/some/draft", "num_speculative_tokens": 2, "prompt_lookup_min": 2},
            "speculative_config.prompt_lookup_min",
        ),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_min",
        ),
        ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max"),
        (
            {"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
            "speculative_config.draft_tensor_parallel_size",
        ),
        ("{not json", "speculative_config"),
        ([1, 2], "speculative_config"),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size"),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": "8"}, "speculative_config.disable_by_batch_size"),
    ],
)
def test_bad_speculative_configs_are_refused_naming_the_field(value, field):
    with pytest.raises(InvalidRequestError) as e:
        SpeculativeConfig.parse(value)
    assert e.value.param == field


def test_a_draft_model_config_parses_with_or_without_its_method():
    """vLLM's keys: `model` implies method "draft_model" (whether the directory holds a model is
    checked where models load: entrypoints/draft_check.py)."""
    for value in (
        {"model": "/d", "num_speculative_tokens": 3},
        {"method": "draft_model", "model": "/d", "num_speculative_tokens": 3},
    ):
        spec = SpeculativeConfig.parse(value)
        assert spec is not None and spec.uses_draft_model and spec.model == "/d" and spec.num_speculative_tokens == 3
    assert not SpeculativeConfig.parse('{"num_speculative_tokens": 2}').uses_draft_model


def test_config_defaults_follow_vllms_rule():
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 4, "prompt_lookup_max": 3}') == SpeculativeConfig(
        4, "ngram", 3, 3
    )
    assert SpeculativeConfig.parse({"num_speculative_tokens": 4}) == SpeculativeConfig(4, "ngram", 5, 2)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 4}).disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    never = SpeculativeConfig.parse({"num_speculative_tokens": 4, "disable_by_batch_size": None})
    assert never is not None and never.disable_by_batch_size is None and never.proposes_at(10**6)
    four = SpeculativeConfig.parse({"num_speculative_tokens": 4, "disable_by_batch_size": 4})
    assert four is not None and four.proposes_at(4) and not four.proposes_at(5)


def test_beam_search_is_refused_with_speculation():
    engine, _ = make_engine()
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("b", [1, 2, 3], SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=4))
    assert e.value.param == "use_beam_search"


# ---- exactness -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("block_size", "budget", "blocks", "prefix", "async_scheduling"),
    [
        (4, 64, 256, True, False),
        (4, 64, 256, False, False),
        (16, 64, 256, True, False),
        (4, 7, 256, True, False),
        (4, 64, 18, True, False),
        (4, 64, 256, True, True),
        (4, 64, 18, True, True),
    ],
)
def test_greedy_with_speculation_is_the_reference(block_size, budget, blocks, prefix, async_scheduling):
    """Greedy output equals the runner's own output alone, token for token, with proposals accepted
    and rejected, chunked prefill (a budget of 7), prefix caching, forced preemption (18 blocks)
    and async scheduling (steps that propose run synchronously, the others ahead)."""
    engine, runner = make_engine(block_size, blocks, budget, prefix, async_scheduling=async_scheduling)
    assert engine.async_scheduling == async_scheduling
    reqs = prompts(block_size + budget + blocks)
    done = run_all(engine, reqs, lambda i: SamplingParams(temperature=0, max_tokens=30 + i, ignore_eos=True))
    for i, p in enumerate(reqs):
        assert done[f"r{i}"].outputs[0].token_ids == reference_generate(p, 30 + i, copy_period=PERIOD), i
    m = engine.get_metrics()
    assert m["spec_decode_num_accepted_tokens"] > 0
    assert m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]  # rejections too
    if not async_scheduling:  # async + preemption over-counts sampled rows, with or without speculation
        assert m["num_generation_tokens"] == sum(30 + i for i in range(len(reqs)))
    if blocks == 18:
        assert m["num_preemptions"] > 0


def test_speculation_takes_fewer_steps_and_metrics_add_up():
    reqs = prompts(1, n=4)
    runs = {}
    for k in (0, 4):
        engine, runner = make_engine(k=k)
        done = run_all(engine, reqs, lambda i: SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        runs[k] = (runner.steps, [done[f"r{i}"].outputs[0].token_ids for i in range(len(reqs))], engine.get_metrics())
    assert runs[4][1] == runs[0][1]
    assert runs[4][0] < runs[0][0]
    m = runs[4][2]
    per_pos = m["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 4 and sum(per_pos) == m["spec_decode_num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
    assert per_pos[0] <= m["spec_decode_num_drafts"]
    assert m["spec_decode_acceptance_rate"] == m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_draft_tokens"]
    assert (
        m["spec_decode_mean_acceptance_length"]
        == 1 + m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_drafts"]
    )
    assert runs[0][2]["spec_decode_num_drafts"] == 0 and runs[0][2]["spec_decode_num_accepted_tokens_per_pos"] == []


def test_no_proposals_above_disable_by_batch_size():
    """disable_by_batch_size=2: steps over more than 2 running sequences verify nothing; once the
    short requests finish, the last two speculate; the output is the reference either way."""
    cfg = SpeculativeConfig.parse({"num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 2})
    engine, runner = make_engine(k=3)
    engine.scheduler.speculator.config = cfg
    seen: list[tuple[int, bool]] = []
    execute = runner.execute

    def recording(out):
        seen.append((len(engine.scheduler.running), any(s.spec_token_ids for s in out.scheduled)))
        return execute(out)

    runner.execute = recording
    reqs = prompts(3, n=4)
    limits = [12, 14, 60, 60]
    done = run_all(engine, reqs, lambda i: SamplingParams(temperature=0, max_tokens=limits[i], ignore_eos=True))
    for i, p in enumerate(reqs):
        assert done[f"r{i}"].outputs[0].token_ids == reference_generate(p, limits[i], copy_period=PERIOD), i
    assert any(n > 2 for n, _ in seen) and all(n <= 2 for n, spec in seen if spec)
    assert any(spec for _, spec in seen)


def test_max_tokens_and_max_model_len_are_never_passed_by_a_run():
    engine, _ = make_engine(max_model_len=40)
    reqs = prompts(2)
    limit = [min(1 + i * 3, 40 - len(p)) for i, p in enumerate(reqs)]  # a few at the whole context
    done = run_all(engine, reqs, lambda i: SamplingParams(temperature=0, max_tokens=limit[i], ignore_eos=True))
    for i, p in enumerate(reqs):
        want = reference_generate(p, limit[i], copy_period=PERIOD)
        assert done[f"r{i}"].outputs[0].token_ids == want, i


def test_stop_token_ids_and_eos_inside_an_accepted_run():
    reqs = prompts(3)
    refs = [reference_generate(p, 40, copy_period=PERIOD) for p in reqs]
    # stop on a token that appears late in each reference (mostly inside a copied run)
    stops = [ref[25] for ref in refs]
    engine, _ = make_engine()
    done = run_all(
        engine, reqs, lambda i: SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stops[i]], min_tokens=3)
    )
    for i, ref in enumerate(refs):
        cut = next(j for j in range(3 - 1, 40) if ref[j] == stops[i])  # min_tokens: not before the third
        out = done[f"r{i}"].outputs[0]
        assert out.token_ids == ref[: cut + 1] and out.finish_reason == "stop", i
    # tokens past a stop inside a run are not counted as generated
    assert engine.get_metrics()["num_generation_tokens"] == sum(len(d.outputs[0].token_ids) for d in done.values())
    eos_engine, _ = make_engine()
    eos_engine.core.scheduler.eos_token_ids = frozenset({stops[0]})
    done = run_all(eos_engine, reqs[:1], lambda i: SamplingParams(temperature=0, max_tokens=40))
    assert done["r0"].outputs[0].token_ids == refs[0][: refs[0].index(stops[0]) + 1]


def test_stop_strings_inside_an_accepted_run():
    reqs = prompts(4, n=4)
    refs = [reference_generate(p, 40, copy_period=PERIOD) for p in reqs]
    tok = CharTokenizer()
    stops = [tok.decode(ref[20:22]) for ref in refs]
    engine, _ = make_engine(tokenizer=tok)
    done = run_all(engine, reqs, lambda i: SamplingParams(temperature=0, max_tokens=40, stop=[stops[i]]))
    for i, ref in enumerate(refs):
        text = tok.decode(ref)
        assert done[f"r{i}"].outputs[0].text == text[: text.index(stops[i])], i


def test_parallel_samples_and_logprobs_speculate_on_their_own():
    """n > 1: each sample (its own seed) speculates alone; logprobs come one per emitted token,
    scored at its own row (the fake's logprobs depend on the context read back)."""
    reqs = prompts(5, n=3)
    outs = {}
    for k in (0, 3):
        cfg_engine, runner = make_engine(k=k)
        runner.salt_by_seed = True
        done = run_all(
            cfg_engine, reqs, lambda i: SamplingParams(n=3, seed=7 + i, max_tokens=30, logprobs=2, ignore_eos=True)
        )
        outs[k] = {
            rid: [(o.token_ids, [sorted(d.items()) for d in o.logprobs]) for o in r.outputs] for rid, r in done.items()
        }
        if k:
            assert cfg_engine.get_metrics()["spec_decode_num_accepted_tokens"] > 0
    assert outs[3] == outs[0]


def test_rollback_frees_rejected_blocks_and_shows_in_the_trace():
    trace: list = []
    engine, runner = make_engine(block_size=2, k=6, trace=True, trace_sink=trace)
    done = run_all(engine, prompts(6, n=3), lambda i: SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert len(done) == 3
    rollbacks = [e for e in trace if e["event"] == "ROLLBACK"]
    assert rollbacks
    # each rolled-back block is released right after (and, holding no hash, never evicted later)
    for e in rollbacks:
        i = trace.index(e)
        assert trace[i + 1]["event"] == "RELEASE" and trace[i + 1]["block_id"] == e["block_id"]
        assert trace[i + 1]["ref_cnt"] == 0
    # the trace viewer reads such a trace: ROLLBACK lines are skipped, their RELEASEs drawn
    from pagedllm.entrypoints.trace_view import parse_trace

    events, skipped = parse_trace([json.dumps(e) for e in trace], "spec.jsonl")
    assert skipped == len(rollbacks) and len(events) == len(trace) - len(rollbacks)


def test_backoff_pauses_speculation_where_it_does_not_pay():
    b = Backoff()
    on = []
    for _ in range(40):  # every step that proposes is rejected
        started = b.start_step()
        on.append(started)
        if started:
            b.record(4, 0)
    pauses = [len(run) for run in "".join("x" if o else "." for o in on).split("x") if run]
    assert pauses[:4] == [1, 2, 4, 8]  # paused ever longer
    assert b.on() is False or b.backoff == 32
    b.off_steps = 0
    b.record(4, 3)  # one step that pays resets the pause
    assert b.on() and b.backoff == 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculation_turns_itself_down_on_random_output(async_scheduling):
    """Output that never copies (the hash rule): proposals (1-grams match often) are rejected, so
    proposing pauses; output is still the reference; with async scheduling most steps run ahead."""
    engine, runner = make_engine(copy_period=None, async_scheduling=async_scheduling, max_num_seqs=2)
    drains = []
    resolve_inflight = engine.core._resolve_inflight
    engine.core._resolve_inflight = lambda: drains.append(1) or resolve_inflight()
    reqs = prompts(7, n=2)
    done = run_all(engine, reqs, lambda i: SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    for i, p in enumerate(reqs):
        assert done[f"r{i}"].outputs[0].token_ids == reference_generate(p, 120), i
    m = engine.get_metrics()
    assert 0 < m["spec_decode_num_drafts"] < runner.steps / 3, (m["spec_decode_num_drafts"], runner.steps)
    assert m["spec_decode_acceptance_rate"] < 0.2
    if async_scheduling:  # paused, the engine runs ahead: few steps wait for the one in flight
        assert 0 < len(drains) < runner.steps / 3, (len(drains), runner.steps)


@pytest.mark.parametrize("seed", range(12))
def test_random_configurations_keep_every_invariant(seed):
    """Random block sizes, budgets, pools (preemption), k, prefix caching, async scheduling, n,
    stop ids and an abort: outputs are the reference's, every block invariant holds after every
    step (no findable block holds an unaccepted token's KV), and every block is free at the end."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    engine, runner = make_engine(
        block_size=block_size,
        blocks=rng.choice([12, 24, 64]) * 8 // block_size,
        budget=rng.choice([5, 16, 64]),
        prefix=rng.random() < 0.7,
        max_num_seqs=rng.choice([2, 4, 8]),
        k=rng.choice([1, 2, 5]),
        async_scheduling=rng.random() < 0.5,
    )
    runner.salt_by_seed = True
    reqs = prompts(100 + seed, n=6)
    refs = [reference_generate(p, 30, seed=50 + i, copy_period=PERIOD) for i, p in enumerate(reqs)]
    stop = {i: refs[i][rng.randrange(30)] for i in range(len(reqs)) if rng.random() < 0.4}
    n = {i: 2 for i in range(len(reqs)) if rng.random() < 0.3}
    aborted = f"r{rng.randrange(len(reqs))}"
    done = run_all(
        engine,
        reqs,
        lambda i: SamplingParams(
            n=n.get(i, 1), seed=50 + i, max_tokens=30, ignore_eos=True, stop_token_ids=[stop[i]] if i in stop else None
        ),
        abort=(6, aborted),
    )
    for i in range(len(reqs)):
        rid = f"r{i}"
        if rid == aborted or rid not in done:
            continue
        ref = refs[i] if i not in stop else refs[i][: refs[i].index(stop[i]) + 1]
        assert done[rid].outputs[0].token_ids == ref, (seed, i)
    assert engine.get_metrics()["spec_decode_num_drafts"] > 0
