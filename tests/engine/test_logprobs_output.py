"""Logprobs in RequestOutputs, through LLMEngine over the ShadowRunner: vLLM's shapes (one dict per
output token, the token first, then the top k), the values the fake computed (recomputed here with
`fake_logprobs`), ranks, cumulative sums, prompt logprobs, stop strings and streaming."""

from __future__ import annotations

import pytest

from pagedllm.engine import LLMEngine, SamplingParams, SchedulerConfig
from pagedllm.engine.outputs import Logprob
from tests.engine.fake_runner import CharTokenizer, ShadowRunner, drain, fake_logprobs, reference_generate

PROMPT = [10, 20, 30, 40, 50, 60, 70]


def make_engine(async_scheduling=False, tokenizer=True, **kw):
    cfg = SchedulerConfig(**{"num_kv_blocks": 64, "block_size": 4, "max_model_len": 64, **kw})
    return LLMEngine(
        cfg,
        ShadowRunner(cfg.block_size, salt_by_seed=True),
        tokenizer=CharTokenizer() if tokenizer else None,
        vocab_size=97,
        eos_token_ids={5},
        async_scheduling=async_scheduling,
    )


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def mode(request):
    return request.param


def text_of(token_id: int) -> str:
    return CharTokenizer().decode([token_id])


def expected_dict(token: int, k: int, context: list, texts: bool = True) -> dict[int, Logprob]:
    """What the fake reports for `token` after `context`, in vLLM's shape: the token first with
    its own rank, then the top k with ranks 1..k, the token skipped there if it is among them."""
    e = fake_logprobs(token, k, context)
    out = {token: Logprob(e.logprobs[0], e.rank, text_of(token) if texts else None)}
    for r, (tid, lp) in enumerate(zip(e.token_ids[1:], e.logprobs[1:], strict=True), start=1):
        if tid != token:
            out[tid] = Logprob(lp, r, text_of(tid) if texts else None)
    return out


def expected_sample_logprobs(prompt, tokens, k, texts=True):
    ctx = [(p, t) for p, t in enumerate(prompt)]
    out = []
    for t in tokens:
        out.append(expected_dict(t, k, list(ctx), texts))
        ctx.append((len(ctx), t))
    return out


def cumulative(prompt, tokens) -> float:
    total = 0.0
    for d, t in zip(expected_sample_logprobs(prompt, tokens, 0), tokens, strict=True):
        total += d[t].logprob
    return total


def generate(engine, prompt=PROMPT, stream=False, **params):
    engine.add_request("r", prompt, SamplingParams(**{"max_tokens": 8, "ignore_eos": True, **params}), stream=stream)
    return drain(engine)["r"]


@pytest.mark.parametrize("k", [0, 1, 4, 20])
def test_logprobs_per_output_token_in_vllm_shape(mode, k):
    out = generate(make_engine(mode), logprobs=k).outputs[0]
    tokens = reference_generate(PROMPT, 8)
    assert out.token_ids == tokens
    assert out.logprobs == expected_sample_logprobs(PROMPT, tokens, k)
    for t, d in zip(out.token_ids, out.logprobs, strict=True):
        assert next(iter(d)) == t  # the sampled token's entry comes first
        assert len(d) in (k, k + 1)
        top_ranks = [lp.rank for tid, lp in d.items() if tid != t]
        assert top_ranks == sorted(top_ranks) and all(1 <= r <= k for r in top_ranks)
    # some token of the run is among its own top k (k entries, not k + 1), when k is large enough
    if k == 20:
        assert any(len(d) == k for d in out.logprobs) and any(len(d) == k + 1 for d in out.logprobs)
    assert out.cumulative_logprob == pytest.approx(
        sum(d[t].logprob for t, d in zip(out.token_ids, out.logprobs, strict=True))
    )
    assert out.cumulative_logprob == pytest.approx(cumulative(PROMPT, tokens))


def test_the_sampled_token_keeps_its_own_rank_when_it_is_among_the_top_k():
    out = generate(make_engine(), logprobs=20, max_tokens=30).outputs[0]
    seen = 0
    ctx = [(p, t) for p, t in enumerate(PROMPT)]
    for t, d in zip(out.token_ids, out.logprobs, strict=True):
        e = fake_logprobs(t, 20, list(ctx))
        ctx.append((len(ctx), t))
        if t in e.token_ids[1:]:
            seen += 1
            assert d[t].rank == e.rank and d[t].logprob == e.logprobs[0]  # not the top-k entry's
            assert len(d) == 20
    assert seen > 0


def test_no_logprobs_asked_gives_none():
    out = generate(make_engine(), n=2, seed=3)
    assert out.prompt_logprobs is None
    assert all(o.logprobs is None and o.cumulative_logprob is None for o in out.outputs)


def test_prompt_logprobs_one_entry_per_prompt_token(mode):
    out = generate(make_engine(mode), prompt_logprobs=3)
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    for j in range(1, len(PROMPT)):
        assert out.prompt_logprobs[j] == expected_dict(PROMPT[j], 3, PROMPT[:j])
        assert next(iter(out.prompt_logprobs[j])) == PROMPT[j]
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    one = generate(make_engine(mode), prompt=[42], prompt_logprobs=0)
    assert one.prompt_logprobs == [None]


def test_prompt_and_sample_logprobs_with_n_children():
    engine = make_engine()
    out = generate(engine, n=3, seed=11, logprobs=2, prompt_logprobs=1)
    assert len(out.prompt_logprobs) == len(PROMPT)
    assert out.prompt_logprobs[1:] == [expected_dict(PROMPT[j], 1, PROMPT[:j]) for j in range(1, len(PROMPT))]
    for i, o in enumerate(out.outputs):
        tokens = reference_generate(PROMPT, 8, seed=11 + i)
        assert (o.index, o.token_ids) == (i, tokens)
        assert o.logprobs == expected_sample_logprobs(PROMPT, tokens, 2)
        assert o.cumulative_logprob == pytest.approx(cumulative(PROMPT, tokens))


def test_without_a_tokenizer_decoded_token_is_none():
    out = generate(make_engine(tokenizer=False), logprobs=2, prompt_logprobs=2)
    tokens = reference_generate(PROMPT, 8)
    assert out.outputs[0].logprobs == expected_sample_logprobs(PROMPT, tokens, 2, texts=False)
    assert all(lp.decoded_token is None for d in out.prompt_logprobs[1:] for lp in d.values())


def stop_string_in(tokens: list[int], at: int) -> str:
    """A two-character stop string that first occurs in the tokens' text at `at`."""
    text = "".join(text_of(t) for t in tokens)
    stop = text[at : at + 2]
    assert text.find(stop) == at
    return stop


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_drops_the_logprobs_of_the_tokens_it_cuts(mode, stream):
    tokens = reference_generate(PROMPT, 12)
    text = "".join(map(text_of, tokens))
    at = next(i for i in range(3, 10) if text.find(text[i : i + 2]) == i)
    stop = stop_string_in(tokens, at)
    engine = make_engine(mode)
    engine.add_request(
        "r", PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, stop=stop, logprobs=1), stream=stream
    )
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    o = outs[-1].outputs[0]
    assert (o.finish_reason, o.stop_reason) == ("stop", stop)
    assert o.token_ids == tokens[: at + 2]  # up to the token that completed the stop string
    assert len(o.logprobs) == len(o.token_ids)
    assert o.logprobs == expected_sample_logprobs(PROMPT, o.token_ids, 1)
    assert o.cumulative_logprob == pytest.approx(cumulative(PROMPT, o.token_ids))


@pytest.mark.parametrize("stop", [None, "zz"])
def test_streamed_logprobs_grow_with_the_token_ids_and_end_as_the_unstreamed_ones(mode, stop):
    params = dict(n=2, seed=5, logprobs=3, prompt_logprobs=2, stop=stop, max_tokens=10)
    whole = generate(make_engine(mode), **params)
    engine = make_engine(mode)
    engine.add_request("r", PROMPT, SamplingParams(ignore_eos=True, **params), stream=True)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) >= 5 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    for i in range(2):
        sent: list = []
        for out in outs:
            c = out.outputs[i]
            assert c.index == i and len(c.logprobs) == len(c.token_ids)
            assert c.logprobs[: len(sent)] == sent  # cumulative: what went out stays
            new = c.logprobs[len(c.logprobs) - len(c.delta_token_ids) :]
            assert [next(iter(d)) for d in new] == c.delta_token_ids  # the delta is the last entries
            sent = c.logprobs
            assert c.cumulative_logprob == pytest.approx(
                sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True))
            )
        assert outs[-1].outputs[i].logprobs == whole.outputs[i].logprobs
        assert outs[-1].outputs[i].cumulative_logprob == whole.outputs[i].cumulative_logprob
    assert all(o.prompt_logprobs == whole.prompt_logprobs for o in outs)


def test_logprobs_are_decoded_lazily_and_once_per_token_id():
    """The dicts' texts are made when an output is made, for new positions only, one decode per id."""

    class CountingTokenizer(CharTokenizer):
        calls = 0

        def decode(self, ids, skip_special_tokens=True):
            CountingTokenizer.calls += 1
            return super().decode(ids, skip_special_tokens)

    cfg = SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=64)
    engine = LLMEngine(cfg, ShadowRunner(4), tokenizer=CountingTokenizer(), vocab_size=97)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=20), stream=False)
    while engine.has_unfinished_requests():
        before = CountingTokenizer.calls
        outs = engine.step()
        if not outs:
            assert CountingTokenizer.calls == before  # nothing decoded while nobody asks
    ids = {tid for d in outs[0].outputs[0].logprobs for tid in d}
    text_decodes = CountingTokenizer.calls
    assert text_decodes <= len(ids) + 2  # one per distinct id (+ the whole text, decoded once)
