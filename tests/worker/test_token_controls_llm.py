"""The token controls end to end through LLM.generate on the tiny float32 model (CPU): greedy
tokens with repetition_penalty equal HF generate's, allowed_token_ids and bad words are never
violated by seeded temperature-1 draws (sync and async scheduling), and a batch that uses no
control builds none."""

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import VOCAB
from tests.model.hf_reference import hf_model

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [40, 41, 42, 43]]
N = 16


def tokens(out):
    return out.outputs[0].token_ids


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_models, request):
    return LLM(tiny_models["qwen3"], device="cpu", num_kv_blocks=128, block_size=8, async_scheduling=request.param)


@pytest.fixture(scope="module")
def sync_llm(tiny_models):
    return LLM(tiny_models["qwen3"], device="cpu", num_kv_blocks=128, block_size=8, async_scheduling=False)


def test_repetition_penalty_greedy_equals_hf_generate(tiny_models, sync_llm):
    import torch

    model = hf_model(tiny_models["qwen3"])
    penalized = SamplingParams(temperature=0, max_tokens=N, min_tokens=N, repetition_penalty=1.8)
    plain = SamplingParams(temperature=0, max_tokens=N, min_tokens=N)
    outs = sync_llm.generate(PROMPTS + PROMPTS, [penalized] * 2 + [plain] * 2, use_tqdm=False)
    for prompt, out, free in zip(PROMPTS, outs[:2], outs[2:], strict=True):
        with torch.inference_mode():
            ref = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=N,
                min_new_tokens=N,
                do_sample=False,
                repetition_penalty=1.8,
                pad_token_id=0,
            )
        assert tokens(out) == ref[0, len(prompt) :].tolist()
        plain_ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0
        )
        assert tokens(free) == plain_ref[0, len(prompt) :].tolist()  # the unpenalized rows of the batch
    assert [tokens(o) for o in outs[:2]] != [tokens(o) for o in outs[2:]]  # the penalty changed something


def _draws(llm, **controls):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=N, ignore_eos=True, **controls) for s in range(6)]
    params.append(SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, **controls))  # greedy too
    return [tokens(o) for o in llm.generate([PROMPTS[0]] * len(params), params, use_tqdm=False)]


def test_allowed_token_ids_are_never_left(llm):
    allowed = [10, 11, 12, VOCAB - 1]
    for toks in _draws(llm, allowed_token_ids=allowed):
        assert len(toks) == N and set(toks) <= set(allowed), toks


def test_single_token_bad_words_are_never_drawn(llm):
    banned = list(range(0, VOCAB - 64))  # most of the vocabulary
    for toks in _draws(llm, bad_words_token_ids=[[t] for t in banned]):
        assert len(toks) == N and not set(toks) & set(banned), toks


def _has(toks, word):
    return any(toks[i : i + len(word)] == word for i in range(len(toks) - len(word) + 1))


def test_multi_token_bad_words_never_complete(sync_llm):
    allowed = [10, 11, 12]
    words = [[10, 11], [12, 12, 12]]
    free = _draws(sync_llm, allowed_token_ids=allowed)
    assert all(any(_has(t, w) for t in free) for w in words)  # drawn freely, the words do occur
    for toks in _draws(sync_llm, allowed_token_ids=allowed, bad_words_token_ids=words):
        assert len(toks) == N and not any(_has(toks, w) for w in words), toks


def test_a_batch_without_controls_builds_none(sync_llm):
    runner = sync_llm.runner
    seen = []
    build = runner.step_inputs

    def spy(out):
        inp = build(out)
        seen.append(inp.logits_controls)
        return inp

    runner.step_inputs = spy
    try:
        sync_llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=1, max_tokens=4), use_tqdm=False)
        assert seen and all(c is None for c in seen)
        seen.clear()
        sync_llm.generate(PROMPTS, [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, presence_penalty=1.0)])
        assert seen and all(c is not None and c.penalty_rows.tolist() == [1] for c in seen)
    finally:
        del runner.step_inputs
