"""Beam search against HF transformers' `generate(num_beams=...)` in float32: the same beams in
the same order, the same scores, under every scheduling configuration."""

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.engine.errors import InvalidRequestError
from tests.model.hf_reference import hf_model

PROMPTS = [
    [5, 17, 99, 23, 4, 8, 100, 200, 31],
    [7, 7, 301, 45, 12],
    [5, 17, 99, 23, 4, 8, 100, 200, 31, 66, 2, 90, 118, 250, 3, 77, 9],  # shares a prefix with the first
]


def hf_beams(path, prompt, width, max_tokens, length_penalty=1.0, early_stopping=False, eos=None):
    """HF's returned beams: (output tokens up to and with the first EOS, score), best first."""
    return _hf_beams(path, tuple(prompt), width, max_tokens, length_penalty, early_stopping, tuple(eos or ()))


@functools.lru_cache(maxsize=64)
@torch.inference_mode()
def _hf_beams(path, prompt, width, max_tokens, length_penalty, early_stopping, eos):
    prompt, eos = list(prompt), (list(eos) or None)
    model = hf_model(path)
    eos = model.generation_config.eos_token_id if eos is None else eos
    out = model.generate(
        torch.tensor([prompt]),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=max_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=eos,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    eos_set = set(eos) if isinstance(eos, list) else {eos}
    beams = []
    for seq, score in zip(out.sequences[:, len(prompt) :].tolist(), out.sequences_scores.tolist(), strict=True):
        for i, t in enumerate(seq):
            if t in eos_set:
                seq = seq[: i + 1]
                break
        beams.append((seq, score))
    return beams


def check(outputs, expected):
    for out, want in zip(outputs, expected, strict=True):
        got = [(s.output_token_ids, s.score) for s in out.sequences]
        assert [g[0] for g in got] == [w[0] for w in want]
        for (_, a), (_, b) in zip(got, want, strict=True):
            assert a == pytest.approx(b, abs=1e-4)


@pytest.fixture(scope="module")
def eos_model(tiny_models, tmp_path_factory):
    """The tiny qwen3 with its EOS (id 0) made likely wherever the model's favourite tokens are:
    its output-embedding row is half the sum of theirs. Hypotheses then finish at many lengths,
    and early_stopping and length_penalty change which beams win (HF's answers differ)."""
    from safetensors.torch import load_file, save_file

    src = tiny_models["qwen3"]
    d = str(tmp_path_factory.mktemp("eos_model"))
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), os.path.join(d, f))
    top = hf_beams(src, PROMPTS[0], 4, 6)
    favourite = list(dict.fromkeys([top[0][0][0], *top[1][0][:5], top[0][0][1], top[0][0][3]]))  # 8 tokens
    weights = load_file(os.path.join(d, "model.safetensors"))
    key = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"  # tied
    weights[key][0] = weights[key][favourite].sum(0) * 0.5
    save_file(weights, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    return d, [0]


@pytest.fixture(scope="module")
def eos_llm(eos_model):
    return LLM(eos_model[0], num_kv_blocks=256, block_size=8)


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("width", [2, 4])
def test_eos_hits_length_penalty_and_early_stopping_equal_hf(eos_model, eos_llm, width, length_penalty, early_stopping):
    path, eos = eos_model
    kw = dict(length_penalty=length_penalty, early_stopping=early_stopping)
    outs = eos_llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=10, **kw))
    check(outs, [hf_beams(path, p, width, 10, length_penalty, early_stopping, eos) for p in PROMPTS])
    for out in outs:
        for s in out.sequences:
            assert (s.output_token_ids[-1] in eos) == (s.finish_reason == "stop")
            assert s.score == pytest.approx(s.cum_logprob / len(s.output_token_ids) ** length_penalty, abs=1e-5)


def test_early_stopping_matters_here(eos_model):
    """The settings above are not all alike: hypotheses end with EOS inside max_tokens, and
    early_stopping=True returns other beams than False."""
    path, eos = eos_model

    def beams(width, lp, es):
        return [hf_beams(path, p, width, 10, lp, es, eos) for p in PROMPTS]

    assert any(seq[-1] in eos and len(seq) < 10 for b in beams(4, 1.0, True) for seq, _ in b)
    assert beams(4, 1.0, True) != beams(4, 1.0, False)
    assert beams(2, 1.0, "never") != beams(2, 1.0, False)


@pytest.mark.parametrize(
    "kw",
    [
        {"enable_prefix_caching": False, "block_size": 8},
        {"block_size": 16},
        {"block_size": 8, "max_num_batched_tokens": 16},  # chunked prompts
        {"block_size": 8, "num_kv_blocks": 17},  # a pool that forces preemption of beam groups
        {"block_size": 8, "async_scheduling": True},
    ],
    ids=["no-prefix-cache", "block-16", "chunked", "preemption", "async"],
)
def test_scheduling_never_changes_the_beams(eos_model, kw):
    path, eos = eos_model
    kw = {"num_kv_blocks": 256, **kw}
    llm = LLM(path, **kw)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=10))
    check(outs, [hf_beams(path, p, 4, 10, eos=eos) for p in PROMPTS])
    m = llm.get_metrics()
    if kw["num_kv_blocks"] == 17:
        assert m["num_preemptions"] > 0
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]


def test_beam_search_beside_sampling_and_through_generate(tiny_models):
    """Beam requests share steps with ordinary ones; SamplingParams(use_beam_search=True) through
    generate gives the same beams as LLM.beam_search, as CompletionOutputs (best first)."""
    path = tiny_models["llama"]
    llm = LLM(path, num_kv_blocks=256, block_size=8)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    beam = SamplingParams(n=3, use_beam_search=True, temperature=0, max_tokens=7)
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [beam, greedy, beam], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    want = [hf_beams(path, p, 3, 7) for p in (PROMPTS[0], PROMPTS[2])]
    for out, w in zip((outs[0], outs[2]), want, strict=True):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert [c.token_ids for c in out.outputs] == [x[0] for x in w]
        assert [c.score for c in out.outputs] == pytest.approx([x[1] for x in w], abs=1e-4)
        assert all(c.text for c in out.outputs)


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 65}, "beam_width"),
        ({"temperature": 0.7}, "temperature"),
        ({"length_penalty": float("nan")}, "length_penalty"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
    ],
)
def test_bad_beam_search_params_name_the_field(kw, param):
    with pytest.raises(InvalidRequestError) as e:
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kw})
    assert e.value.param == param


@pytest.mark.parametrize(
    ("kw", "param"),
    [({"logprobs": 2}, "logprobs"), ({"best_of": 3}, "best_of"), ({"stop": ["x"]}, "stop"), ({"seed": 1}, "seed")],
)
def test_beam_search_refuses_what_it_does_not_do(kw, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(n=2, use_beam_search=True, temperature=0, **kw)
    assert e.value.param == param


@pytest.mark.parametrize("kw", [{"length_penalty": 0.5}, {"early_stopping": True}])
def test_beam_knobs_without_beam_search_are_refused(kw):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == next(iter(kw))


def test_beam_width_above_max_num_seqs_is_refused(tiny_models):
    llm = LLM(tiny_models["qwen3"], num_kv_blocks=64, block_size=8, max_num_seqs=4)
    with pytest.raises(InvalidRequestError) as e:
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=5, max_tokens=4))
    assert e.value.param == "n"
    assert len(llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=4, max_tokens=4))[0].sequences) == 4
