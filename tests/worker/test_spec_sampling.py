"""Verification rows through the real step-input builder and sampler: every emitted token is
distributed exactly as the target's (chi-square against the processed distribution), at several
temperatures with top-k, top-p, min-p and a presence penalty that must count the accepted
proposal as output; and a seeded row draws the same token with or without speculation.

The "model" is a fixed logits row per position (the same for every sequence), so the target's
distribution at each row is known in closed form; each of N sequences (own seed) is one trial.
"""

import math

import numpy as np
import pytest
import torch

from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedllm.engine.sequence import Sequence
from pagedllm.engine.spec_verify import accepted_run
from pagedllm.worker.sampler import sample, sampling_tensors
from pagedllm.worker.step_inputs import build_step_inputs

V = 8
PROMPT = [3, 1, 4, 1, 5]
ROW0 = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])  # logits after PROMPT
ROW1 = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 1.5, -0.5, 0.2])  # logits after PROMPT + [d1]
D1, D2 = 1, 2  # the proposals


def processed(logits, p: SamplingParams, output_ids):
    """The target's distribution, computed here independently of the sampler: presence penalty
    over the output so far, temperature, top-k, top-p (keep the smallest set of top tokens whose
    mass reaches p), min-p."""
    x = logits.double().clone()
    for t in set(output_ids):
        x[t] -= p.presence_penalty
    if p.temperature == 0:
        out = torch.zeros(V, dtype=torch.float64)
        out[x.argmax()] = 1
        return out
    probs = (x / p.temperature).softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(V, dtype=torch.bool)
    if p.top_k > 0:
        keep[order[: p.top_k]] = True
    else:
        keep[:] = True
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    if p.top_p < 1:
        sorted_p = probs[order]
        mass_before = sorted_p.cumsum(0) - sorted_p
        probs = torch.where(torch.zeros(V, dtype=torch.bool).index_put((order,), mass_before < p.top_p), probs, 0.0)
        probs = probs / probs.sum()
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def verification_step(params: list[SamplingParams], drafts: list[int]):
    """One verification step of len(params) sequences (each PROMPT + one output token, the last
    one computed next), each proposing `drafts`: returns the emitted runs."""
    bs = 16
    sched = []
    for i, p in enumerate(params):
        seq = Sequence(f"r{i}", PROMPT, p)
        seq.append_token(0)  # one output token so far (its row is the last computed)
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.block_tables = [[i]]
        sched.append(ScheduledSequence(seq, 1 + len(drafts), spec_token_ids=list(drafts)))
    inp = build_step_inputs(SchedulerOutput(sched), bs, V, frozenset())
    assert len(inp.logits_indices) == len(params) * (1 + len(drafts))
    rows = [ROW0, ROW1, ROW1][: 1 + len(drafts)]  # row j's logits (row 2 unused unless k = 2)
    logits = torch.stack([rows[j] for _ in params for j in range(1 + len(drafts))])
    t = sampling_tensors(inp, V, torch.device("cpu"), lambda a: torch.from_numpy(np.ascontiguousarray(a)), None)
    sampled = sample(logits.clone(), t).tolist()
    k = 1 + len(drafts)
    return [accepted_run(drafts, sampled[i * k : (i + 1) * k]) for i in range(len(params))]


def chi_square_ok(counts: np.ndarray, probs: torch.Tensor) -> bool:
    """Pearson's chi-square over the tokens of nonzero probability, below its 0.1% critical value
    (Wilson-Hilferty); tokens of probability 0 must never appear."""
    p = probs.numpy()
    n = counts.sum()
    if (counts[p == 0] > 0).any():
        return False
    live = p > 0
    df = int(live.sum()) - 1
    if df == 0:
        return True
    expected = n * p[live]
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    z = 3.09  # the 0.999 quantile of the standard normal
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit


CASES = [
    dict(temperature=0.6),
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, min_p=0.1, presence_penalty=1.5),
    dict(temperature=1.0, top_k=6, top_p=0.9, min_p=0.05, presence_penalty=-0.8),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_emitted_tokens_follow_the_target_distribution(case):
    n = 4000
    params = [SamplingParams(**case, seed=10_000 + i, max_tokens=50) for i in range(n)]
    runs = verification_step(params, [D1, D2])
    p0 = processed(ROW0, params[0], [0])
    first = np.bincount([r[0] for r in runs], minlength=V)
    assert chi_square_ok(first, p0), (first / n, p0)
    # accepted d1 exactly as often as the target draws it
    accepted = [r for r in runs if len(r) > 1]
    assert len(accepted) == first[D1]
    # after an accepted d1 the next token follows row 1's distribution, with d1 counted as output
    p1 = processed(ROW1, params[0], [0, D1])
    second = np.bincount([r[1] for r in accepted], minlength=V)
    assert chi_square_ok(second, p1), (second / max(1, len(accepted)), p1)
    if case.get("presence_penalty"):  # the check can fail: row 1 without d1 in its history differs
        assert not chi_square_ok(second, processed(ROW1, params[0], [0])) or p1[D1] == 0


def test_the_check_can_fail():
    """A sampler that ignored top-k would be caught: the same draws against a wrong target."""
    n = 4000
    params = [SamplingParams(temperature=1.0, top_k=3, seed=i, max_tokens=50) for i in range(n)]
    runs = verification_step(params, [D1])
    first = np.bincount([r[0] for r in runs], minlength=V)
    assert chi_square_ok(first, processed(ROW0, params[0], [0]))
    assert not chi_square_ok(first, processed(ROW0, SamplingParams(temperature=1.0), [0]))


def test_greedy_rows_emit_the_argmax_run():
    params = [SamplingParams(temperature=0, max_tokens=50)]
    assert verification_step(params, [0, 2]) == [[0, 2, 2]]  # both accepted: argmax of each row, then the bonus
    assert verification_step(params, [1, 2]) == [[0]]  # the first is not the argmax: the target's token


def test_a_seeded_row_draws_the_same_token_with_or_without_speculation():
    """Row 0 of a verification step is the plain decode step's row (same seed, same position)."""
    params = [SamplingParams(temperature=1.0, seed=77 + i, max_tokens=50) for i in range(64)]
    with_spec = [r[0] for r in verification_step(params, [D1, D2])]
    without = [r[0] for r in verification_step(params, [])]
    assert with_spec == without
    assert len(set(without)) > 1  # the seeds do draw different tokens
