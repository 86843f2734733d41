"""The token controls on logits: built on the host from sequences (worker/logits_controls.py),
applied on the device (ops/logits_controls.py), compared with HF transformers' logits processors
and the OpenAI formulas on the same logits."""

from collections import Counter

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.scheduler_output import PLACEHOLDER
from pagedllm.engine.sequence import Sequence
from pagedllm.ops.logits_controls import ControlTensors, apply_logits_controls
from pagedllm.worker.logits_controls import TokenHistory, build_logits_controls

V = 64


def seq(prompt, output, **params):
    s = Sequence("r", prompt, SamplingParams(**params))
    s.token_ids += output
    return s


def controlled(logits, seqs, history=None):
    c = build_logits_controls(seqs, V, history or TokenHistory())
    if c is None:
        return None
    return apply_logits_controls(logits.clone(), ControlTensors.to_device(c, torch.from_numpy))


def random_logits(b, seed=0):
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_equals_hf_over_prompt_and_output():
    rows = [([1, 2, 3, 3], [4, 1, 9], 1.3), ([5, 6], [], 0.7), ([7], [7, 7, 8], 2.0)]
    seqs = [seq(p, o, repetition_penalty=r) for p, o, r in rows]
    seqs.insert(1, seq([1, 2], [3], temperature=0))  # uses nothing: left as it is
    logits = random_logits(4)
    got = controlled(logits, seqs)
    assert torch.equal(got[1], logits[1])
    for i, (p, o, r) in zip((0, 2, 3), rows, strict=True):
        want = RepetitionPenaltyLogitsProcessor(r)(torch.tensor([p + o]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], want, rtol=0, atol=0)


def test_presence_and_frequency_count_output_tokens_only():
    prompt, output = [1, 2, 2, 5], [2, 3, 3, 3, 7]
    s = seq(prompt, output, presence_penalty=0.5, frequency_penalty=-0.25)
    logits = random_logits(1)
    got = controlled(logits, [s])[0]
    want = logits[0].clone()
    for tid, n in Counter(output).items():
        want[tid] -= -0.25 * n + 0.5
    torch.testing.assert_close(got, want)
    assert got[1] == logits[0, 1] and got[5] == logits[0, 5]  # prompt-only tokens: untouched


def test_logit_bias_equals_hf_sequence_bias_and_runs_before_the_penalty():
    bias = {3: 5.0, 10: -2.5, V + 100: 1.0}  # an id past the logits has nothing to bias
    logits = random_logits(2)
    got = controlled(
        logits, [seq([1], [], logit_bias=bias), seq([1], [3], logit_bias={3: 2.0}, repetition_penalty=2.0)]
    )
    hf = SequenceBiasLogitsProcessor({(3,): 5.0, (10,): -2.5})(torch.tensor([[1]]), logits[:1].clone())[0]
    torch.testing.assert_close(got[0], hf)
    biased = logits[1, 3] + 2.0  # vLLM's order: bias, then the penalty
    assert got[1, 3] == (biased / 2.0 if biased > 0 else biased * 2.0)


def test_allowed_token_ids_leave_only_those_finite():
    logits = random_logits(2)
    got = controlled(logits, [seq([1], [], allowed_token_ids=[4, 9, 63]), seq([1], [], temperature=0)])
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [4, 9, 63]
    assert torch.equal(got[0, [4, 9, 63]], logits[0, [4, 9, 63]])
    assert torch.equal(got[1], logits[1])


@pytest.mark.parametrize(
    ("prompt", "output", "banned"),
    [
        ([1], [], {5}),  # no output yet: only the single-token word
        ([1, 2], [], {5}),  # the prompt ends with [2] but the prefix is matched over the output
        ([1], [2], {5, 3}),  # output ends with [2]: word [2, 3] bans 3
        ([1], [7, 8], {5, 9}),  # output ends with [7, 8]: word [7, 8, 9] bans 9
        ([7], [8], {5}),  # [7, 8] spans prompt and output: not banned
        ([1], [8, 2, 4], {5}),
    ],
)
def test_bad_words_ban_the_last_token_after_the_rest(prompt, output, banned):
    words = [[5], [2, 3], [7, 8, 9]]
    got = controlled(random_logits(1), [seq(prompt, output, bad_words_token_ids=words)])
    assert set(torch.isinf(got[0]).nonzero().flatten().tolist()) == banned


def test_bf16_logits_are_controlled_in_float32():
    logits = random_logits(1).bfloat16()
    got = controlled(logits, [seq([1, 2], [2], repetition_penalty=1.1, logit_bias={4: 0.01})])
    assert got.dtype == torch.float32
    want = RepetitionPenaltyLogitsProcessor(1.1)(torch.tensor([[1, 2, 2]]), logits.float())[0]
    want[4] += 0.01
    torch.testing.assert_close(got[0], want)


def test_token_history_across_steps_equals_a_fresh_build():
    history = TokenHistory()
    s = seq([1, 2, 3], [], frequency_penalty=1.0, repetition_penalty=1.5)
    logits = random_logits(1)
    for t in [4, 4, 9, 1] * 20:  # grows past its first buffer
        kept = controlled(logits, [s], history)
        fresh = controlled(logits, [s])
        assert torch.equal(kept, fresh)
        s.token_ids.append(t)
    s.token_ids[-1] = 60  # a list rewritten in place is noticed by its last kept id
    s.token_ids.append(61)
    assert torch.equal(controlled(logits, [s], history), controlled(logits, [s]))


def test_a_placeholder_in_a_penalized_history_is_an_error():
    s = seq([1, 2], [3, PLACEHOLDER], presence_penalty=1.0)
    with pytest.raises(AssertionError, match="PLACEHOLDER"):
        controlled(random_logits(1), [s])


def test_packed_arrays_are_two():
    c = build_logits_controls(
        [seq([1], [2], presence_penalty=1.0, logit_bias={1: 1.0}, allowed_token_ids=[1, 2])], V, TokenHistory()
    )
    assert c is not None
    ints, floats = c.packed()
    assert ints.dtype == np.int64 and floats.dtype == np.float32
    assert len(ints) == sum(c.int_sizes()) and len(floats) == 3 + 1


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sample_never_draws_what_the_bitmask_or_controls_forbid(top_p):
    from pagedllm.worker.sampler import SamplingTensors, sample

    b = 64
    allowed = [3, 17, 40, 63]
    bits = np.zeros((b // 2, (V + 31) // 32), dtype=np.int64)
    for t in allowed:
        bits[:, t // 32] |= 1 << (t % 32)
    bits = bits.astype(np.uint32).view(np.int32)  # bit 31 set is a negative int32 word
    seqs = [seq([1], [], allowed_token_ids=[5, 6]) if i % 2 else seq([1], []) for i in range(b)]
    c = build_logits_controls(seqs, V, TokenHistory())
    temperature = torch.tensor([0.0] + [1.0] * (b - 1))
    t = SamplingTensors(
        temperature=temperature,
        top_k=torch.full((b,), V),
        top_p=torch.full((b,), top_p),
        min_p=torch.zeros(b),
        generators=[None] * b,
        all_greedy=False,
        any_greedy=True,
        need_top_k_p=top_p < 1,
        need_min_p=False,
        controls=ControlTensors.to_device(c, torch.from_numpy),
        token_bitmask=(torch.arange(0, b, 2), torch.from_numpy(bits)),  # the even rows
    )
    for s in range(5):
        torch.manual_seed(s)
        got = sample(random_logits(b, seed=s) * 3, t).tolist()
        assert all(got[i] in allowed for i in range(0, b, 2)), got
        assert all(got[i] in (5, 6) for i in range(1, b, 2)), got
