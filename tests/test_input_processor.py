"""The edge of the Python API: what `SamplingParams` and `LLM.generate` (through
`InputProcessor.process`) refuse, each refusal an InvalidRequestError naming the field, and the
engine untouched afterwards. The HTTP side of the same rules is tests/server/test_request_validation.py."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.errors import InvalidRequestError

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    """The tiny qwen3: context 512 tokens, a KV cache of 1,024 (the context is the tighter limit)."""
    with LLM(tiny_models["qwen3"], device="cpu", num_kv_blocks=128, block_size=8) as llm:
        assert llm.engine.config.max_model_len == 512
        yield llm


def refusal(llm: LLM, prompt, **params) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(prompt, SamplingParams(**params), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing was queued
    return e.value


def test_max_tokens_past_the_context_is_refused_not_clamped(llm):
    prompt = [7] * 500  # room for 12
    out = llm.generate(prompt, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    for max_tokens in (13, 2**64):
        e = refusal(llm, prompt, max_tokens=max_tokens, **GREEDY)
        assert (e.param, e.code) == ("max_tokens", "context_length_exceeded")
        assert "512" in e.message and "12" in e.message  # the context, and the most that fits
    # the model's own defaults are a max_tokens like any other: 16 does not fit beside 500 tokens
    assert refusal(llm, prompt).param == "max_tokens"


def test_sampling_params_bound_integers_and_refuse_non_text():
    for fields, param in [
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": -(2**64)}, "top_k"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"stop": "a\ud800"}, "stop"),
        ({"stop": ["ok", "\udfff"]}, "stop"),
        ({"cache_salt": "\ud800"}, "cache_salt"),
        # a seed is a signed 64-bit integer, and the i-th sample draws with seed + i
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**63 - 2, "n": 3}, "seed"),
        ({"seed": 2**63 - 2, "n": 2, "best_of": 3}, "seed"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**fields)
        assert e.value.param == param, fields
    assert SamplingParams(top_k=2**31 - 1).top_k == 2**31 - 1
    # the edges themselves are accepted: the last sample draws with exactly 2**63 - 1
    assert SamplingParams(seed=2**63 - 2, n=2).seed == 2**63 - 2
    assert SamplingParams(seed=2**63 - 3, n=2, best_of=3).seed == 2**63 - 3
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_generate_refuses_out_of_vocabulary_ids_and_surrogate_prompts(llm):
    vocab = llm.hf_config.vocab_size
    assert refusal(llm, [1, 2], stop_token_ids=[vocab]).param == "stop_token_ids"
    assert refusal(llm, [1, 2], stop_token_ids=[2**31 - 1]).param == "stop_token_ids"
    assert refusal(llm, "def \ud800(").param == "prompt"
    assert refusal(llm, {"prompt": "\udc00", "prompt_token_ids": [1]}).param == "prompt"
    assert refusal(llm, [1, 2**64]).param == "prompt"
    # a top_k at or above the vocabulary is off: the same draws as no top_k
    seeded = dict(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    plain = llm.generate([5, 6], SamplingParams(**seeded), use_tqdm=False)[0].outputs[0].token_ids
    wide = llm.generate([5, 6], SamplingParams(top_k=2**31 - 1, **seeded), use_tqdm=False)[0].outputs[0].token_ids
    assert wide == plain


def test_prompt_token_ids_are_plain_ints_in_the_vocabulary(llm):
    """The id checks (one pass in C for a list of plain ints) keep the item-by-item rule: a bool
    is not a token id, another int subclass is; the first id outside the vocabulary is named."""
    import enum

    vocab = llm.hf_config.vocab_size
    for bad in ([1, True, 3], [False], [1, 2.0], [1, "2"], [1, None], [1, [2]]):
        assert refusal(llm, bad).message == "prompt_token_ids must be a list of integers", bad
    assert refusal(llm, {"prompt_token_ids": [3, True]}).param == "prompt"
    for bad, named in (([5, -1, vocab], -1), ([5, vocab, -1], vocab), ([vocab + 7], vocab + 7)):
        e = refusal(llm, bad)
        assert e.param == "prompt" and f"token id {named} is outside" in e.message, (bad, e.message)
    assert "stop_token_ids" == refusal(llm, [1], stop_token_ids=[3, False]).param

    class Tok(enum.IntEnum):
        A = 5

    greedy = SamplingParams(max_tokens=4, **GREEDY)
    plain = llm.generate([5, 6, vocab - 1], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate([Tok.A, 6, vocab - 1], greedy, use_tqdm=False)[0].outputs[0].token_ids == plain
    assert (
        llm.generate({"prompt_token_ids": (5, 6, vocab - 1)}, greedy, use_tqdm=False)[0].outputs[0].token_ids == plain
    )
