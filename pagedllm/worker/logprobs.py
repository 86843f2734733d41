"""Logprobs on the device: of the sampled tokens (per sample row that asks) and of prompt tokens.

Both are the log-softmax of the model's raw logits in float32, before temperature, top-k/p,
min-p and the min_tokens mask (what vLLM v1 returns by default). A scored token comes back as
`TokenLogprobs(token_ids=[token, *top_k_ids], logprobs=[...], rank)` (engine/executor.py),
rank = the number of ids whose logprob is >= the token's (1 = the most likely).

The work is in two phases so that async scheduling never waits: `*_logprobs` queue the
kernels and return device tensors, `.to_host()` starts their copies (non-blocking on CUDA),
and `.entries()` turns the host copies into lists once the step's event has fired.
A step where nothing asks never calls into this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.engine.step_result import PromptLogprobsChunk, TokenLogprobs
from pagedllm.worker.step_inputs import PromptLogprobsRows

# Prompt rows scored per LM-head call: bounds the [rows, vocab] float32 logits a long prompt
# materialises at once (512 x 152k x 4 B = 311 MB for Qwen3's vocabulary).
PROMPT_LOGPROBS_ROWS = 512


@dataclass
class ScoredTokens:
    """R scored tokens: `token_ids[:, 0]` the token, then the top K ids (K = the largest k asked in
    the batch; a row asking fewer keeps the first k); `logprobs` alike; `ranks` the tokens' ranks."""

    token_ids: torch.Tensor  # [R, 1 + K] int64
    logprobs: torch.Tensor  # [R, 1 + K] float32
    ranks: torch.Tensor  # [R] int64

    def to_host(self) -> ScoredTokens:
        """Start the copies to the host: non-blocking from CUDA (pinned), so the caller must wait on
        an event recorded after this before reading them; the tensors themselves on CPU."""
        if not self.token_ids.is_cuda:
            return self
        return ScoredTokens(*(t.to("cpu", non_blocking=True) for t in (self.token_ids, self.logprobs, self.ranks)))

    def entries(self, ks: list[int]) -> list[TokenLogprobs]:
        """One TokenLogprobs per row, row i keeping its own top ks[i] (host tensors only)."""
        ids, lps, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        return [TokenLogprobs(ids[i][: k + 1], lps[i][: k + 1], ranks[i]) for i, k in enumerate(ks)]


def score(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> ScoredTokens:
    """logits: [R, V] raw (any float dtype, left unchanged); token_ids: [R] int64, the tokens scored."""
    lp = logits.float().log_softmax(dim=-1)
    token_lp = lp.gather(-1, token_ids[:, None])
    ranks = (lp >= token_lp).sum(dim=-1)
    k = min(k, lp.shape[-1])
    if k == 0:
        return ScoredTokens(token_ids[:, None], token_lp, ranks)
    top_lp, top_ids = lp.topk(k, dim=-1)  # sorted, best first
    return ScoredTokens(torch.cat([token_ids[:, None], top_ids], dim=-1), torch.cat([token_lp, top_lp], dim=-1), ranks)


@dataclass
class SampleLogprobs:
    """The logprobs of a step's sampled tokens, for the sample rows that asked (`rows`, each with
    its top k in `ks`); `num_rows` is the step's number of sample rows."""

    rows: list[int]
    ks: list[int]
    num_rows: int
    scored: ScoredTokens | None = None

    def to_host(self) -> SampleLogprobs:
        assert self.scored is not None, "finish() was not called"
        return SampleLogprobs(self.rows, self.ks, self.num_rows, self.scored.to_host())

    def entries(self) -> list[TokenLogprobs | None]:
        assert self.scored is not None
        out: list[TokenLogprobs | None] = [None] * self.num_rows
        for row, entry in zip(self.rows, self.scored.entries(self.ks), strict=True):
            out[row] = entry
        return out


class PendingSampleLogprobs:
    """Phase one of sample logprobs, taken before sampling (the sampler may write -inf into the
    logits in place): the raw logits of the rows that ask, copied out. `finish(sampled)` scores
    the sampled tokens once they are drawn."""

    def __init__(
        self,
        logits: torch.Tensor,
        num_logprobs: list[int | None],
        to_device: Callable[[np.ndarray], torch.Tensor],
    ):
        self.rows = [i for i, k in enumerate(num_logprobs) if k is not None]
        self.ks = [k for k in num_logprobs if k is not None]
        self.num_rows = len(num_logprobs)
        self.rows_t = to_device(np.array(self.rows, dtype=np.int64))
        self.logits = logits.index_select(0, self.rows_t)  # a copy: immune to the sampler's mask

    def finish(self, sampled: torch.Tensor) -> SampleLogprobs:
        scored = score(self.logits, sampled.index_select(0, self.rows_t), max(self.ks))
        return SampleLogprobs(self.rows, self.ks, self.num_rows, scored)


@dataclass
class PromptLogprobs:
    """The prompt logprobs of a step: for each PromptLogprobsRows part, in order, its rows of
    `scored` (the parts concatenated)."""

    parts: list[PromptLogprobsRows]
    scored: ScoredTokens | None  # None on a tensor-parallel rank other than 0

    def to_host(self) -> PromptLogprobs:
        return PromptLogprobs(self.parts, None if self.scored is None else self.scored.to_host())

    def chunks(self) -> dict[int, PromptLogprobsChunk]:
        assert self.scored is not None
        ks = [p.k for p in self.parts for _ in range(len(p.target_ids))]
        entries = self.scored.entries(ks)
        out: dict[int, PromptLogprobsChunk] = {}
        at = 0
        for p in self.parts:
            n = len(p.target_ids)
            out[p.seq_id] = PromptLogprobsChunk(p.start, entries[at : at + n])
            at += n
        return out


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    parts: list[PromptLogprobsRows],
    to_device: Callable[[np.ndarray], torch.Tensor],
    score_on_this_rank: bool = True,
) -> PromptLogprobs:
    """Score the prompt tokens of `parts` from the step's hidden states [T, hidden], in slices of
    PROMPT_LOGPROBS_ROWS rows. Under tensor parallelism compute_logits is a collective: every rank
    calls it with the same slices (their shapes come from the StepInputs every rank has); only
    rank 0 (score_on_this_rank) scores them."""
    rows = np.concatenate([p.first_row + np.arange(len(p.target_ids), dtype=np.int64) for p in parts])
    targets = np.concatenate([p.target_ids for p in parts]).astype(np.int64)
    k = max(p.k for p in parts)
    rows_t, targets_t = to_device(rows), to_device(targets)
    pieces: list[ScoredTokens] = []
    for a in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
        b = a + PROMPT_LOGPROBS_ROWS
        logits = compute_logits(hidden.index_select(0, rows_t[a:b]))
        if score_on_this_rank:
            pieces.append(score(logits, targets_t[a:b], k))
    if not score_on_this_rank:
        return PromptLogprobs(parts, None)
    if len(pieces) == 1:
        return PromptLogprobs(parts, pieces[0])
    return PromptLogprobs(
        parts,
        ScoredTokens(
            torch.cat([p.token_ids for p in pieces]),
            torch.cat([p.logprobs for p in pieces]),
            torch.cat([p.ranks for p in pieces]),
        ),
    )
