"""best_of and n through LLMEngine over the ShadowRunner (salt_by_seed: the children of a forked row
draw different tokens): best_of returns the n samples with the highest cumulative logprob, best
first, re-indexed; it is never streamed; n > 1 streams every index."""

from __future__ import annotations

import pytest

from pagedllm.engine import SamplingParams
from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.input_processor import InputProcessor
from tests.engine.fake_runner import CharTokenizer, drain, reference_generate
from tests.engine.test_logprobs_output import PROMPT, cumulative, expected_sample_logprobs, make_engine


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def mode(request):
    return request.param


def independent(engine, seeds, max_tokens, **params):
    """Each seed as its own n=1 request (logprobs=0 for the cumulative logprob): seed -> output."""
    for s in seeds:
        engine.add_request(f"s{s}", PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=s, logprobs=0))
    done = drain(engine)
    return {s: done[f"s{s}"].outputs[0] for s in seeds}


@pytest.mark.parametrize("best_of,n", [(4, 2), (5, 1), (6, 4)])
def test_best_of_returns_the_n_highest_cumulative_logprobs_best_first(mode, best_of, n):
    seed, max_tokens = 21, 6
    engine = make_engine(mode)
    alone = independent(engine, range(seed, seed + best_of), max_tokens)
    engine.add_request(
        "r", PROMPT, SamplingParams(n=n, best_of=best_of, seed=seed, max_tokens=max_tokens, ignore_eos=True)
    )
    out = drain(engine)["r"]
    ranked = sorted(alone.values(), key=lambda o: -o.cumulative_logprob)[:n]
    assert len({o.cumulative_logprob for o in alone.values()}) > 1  # a test where the choice matters
    assert [o.index for o in out.outputs] == list(range(n))
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ranked]
    assert [o.cumulative_logprob for o in out.outputs] == pytest.approx([o.cumulative_logprob for o in ranked])
    for o in out.outputs:
        assert o.logprobs is None  # best_of asked for the cumulative logprob only, not the user
        assert o.cumulative_logprob == pytest.approx(cumulative(PROMPT, o.token_ids))
        assert o.finish_reason == "length"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_best_of_equal_to_n_is_plain_n():
    """Nothing to choose: every sample in index order, no logprobs asked for, none computed."""
    engine = make_engine()
    engine.add_request("r", PROMPT, SamplingParams(n=3, best_of=3, seed=21, max_tokens=6, ignore_eos=True))
    out = drain(engine)["r"]
    assert [o.token_ids for o in out.outputs] == [reference_generate(PROMPT, 6, seed=21 + i) for i in range(3)]
    assert [(o.index, o.cumulative_logprob, o.logprobs) for o in out.outputs] == [(i, None, None) for i in range(3)]


def test_best_of_with_logprobs_shows_them_for_the_chosen():
    engine = make_engine()
    engine.add_request("r", PROMPT, SamplingParams(n=2, best_of=4, seed=3, logprobs=2, max_tokens=5, ignore_eos=True))
    out = drain(engine)["r"]
    all_four = [reference_generate(PROMPT, 5, seed=3 + i) for i in range(4)]
    best = sorted(all_four, key=lambda t: -cumulative(PROMPT, t))[:2]
    assert [o.token_ids for o in out.outputs] == best
    assert [o.logprobs for o in out.outputs] == [expected_sample_logprobs(PROMPT, t, 2) for t in best]


def test_best_of_is_never_streamed(mode):
    """stream=True for a best_of > n request: no partial outputs, one final output (the n best)."""
    engine = make_engine(mode)
    engine.add_request("r", PROMPT, SamplingParams(n=1, best_of=3, seed=8, max_tokens=6, ignore_eos=True), stream=True)
    engine.add_request("s", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True), stream=True)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    mine = [o for o in outs if o.request_id == "r"]
    assert len(mine) == 1 and mine[0].finished
    c = mine[0].outputs[0]
    assert len(mine[0].outputs) == 1 and c.index == 0
    assert c.delta_token_ids == c.token_ids and c.delta_text == c.text  # everything, at once
    assert len([o for o in outs if o.request_id == "s"]) == 6  # a plain request streams as before


def test_an_aborted_best_of_request_ends_with_its_best_so_far():
    engine = make_engine()
    engine.add_request("r", PROMPT, SamplingParams(n=2, best_of=3, seed=8, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        engine.step()
    state = engine.output_processor.requests["r"]
    assert engine.abort_request("r")
    out = engine.output_processor.make_output(state)
    assert [o.index for o in out.outputs] == [0, 1] and all(o.finish_reason == "abort" for o in out.outputs)
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("stop", [None, "#"])
def test_n_streams_every_index_and_each_equals_its_seeded_request(mode, stop):
    seed, n = 40, 3
    engine = make_engine(mode)
    engine.add_request(
        "r", PROMPT, SamplingParams(n=n, seed=seed, max_tokens=7, ignore_eos=True, stop=stop), stream=True
    )
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and len(outs) >= 7
    for i in range(n):
        expected = reference_generate(PROMPT, 7, seed=seed + i)
        assert all(o.outputs[i].index == i for o in outs)
        assert [t for o in outs for t in o.outputs[i].delta_token_ids] == outs[-1].outputs[i].token_ids
        assert "".join(o.outputs[i].delta_text for o in outs) == outs[-1].outputs[i].text
        final = outs[-1].outputs[i]
        if "#" not in CharTokenizer().decode(expected) or stop is None:
            assert final.token_ids == expected
        else:  # cut by the stop string: a prefix up to the token that completed it
            assert final.stop_reason == "#" and expected[: len(final.token_ids)] == final.token_ids
    assert len({tuple(outs[-1].outputs[i].token_ids) for i in range(n)}) == n  # the children differ


def test_num_samples_past_max_num_seqs_are_accepted_up_to_max_samples():
    from pagedllm.engine.input_processor import MAX_SAMPLES

    ip = InputProcessor(CharTokenizer(), 97, 64, 4, 64, max_num_seqs=4)
    assert ip.process("a", PROMPT, SamplingParams(n=9)).params.n == 9  # waves of 4 (engine/core.py)
    assert ip.process("b", PROMPT, SamplingParams(n=2, best_of=9)).params.best_of == 9
    for params, name in [
        (SamplingParams(n=MAX_SAMPLES + 1), "n"),
        (SamplingParams(n=2, best_of=MAX_SAMPLES + 1), "best_of"),
    ]:
        with pytest.raises(InvalidRequestError, match=f"at most {MAX_SAMPLES}") as e:
            ip.process("c", PROMPT, params)
        assert e.value.param == name
    assert InputProcessor(CharTokenizer(), 97, 64, 4, 64).process("d", PROMPT, SamplingParams(n=300)).params.n == 300
