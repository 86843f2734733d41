"""Speculative decoding, the proposing half: the n-gram (prompt lookup) proposer, the bound on how
many proposals a sequence may verify in one step, and when to propose at all (Backoff). The config
is spec_config.py's; spec_verify.py verifies the proposals.

A proposal is a point mass: the proposer names k' tokens, no distribution. The verification step
computes the target's logits at the 1 + k' positions [last token, d_1 .. d_k'] and draws a token
from each row exactly as without speculation (row j's processed distribution given the tokens
before it plus d_1 .. d_j). Rejection sampling with a point-mass proposal q = delta(d) accepts d
with probability min(1, p(d) / q(d)) = p(d) and, on rejection, draws from p with d removed and
renormalized; drawing x ~ p and accepting d exactly when x == d does both at once (P(x == d) =
p(d), and x given x != d is that residual). So each emitted token is distributed exactly as the
target's, greedy rows emit the target's argmax, and a seeded row's draw, keyed by (seed, position)
as without speculation (worker/sampler.py), is the same token with or without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pagedllm.engine.scheduler_output import PLACEHOLDER
from pagedllm.engine.spec_config import SpeculativeConfig

if TYPE_CHECKING:
    from pagedllm.engine.kv_cache_manager import KVCacheManager
    from pagedllm.engine.sequence import Sequence
    from pagedllm.engine.structured_output import SequenceGrammar


class NgramProposer:
    """Prompt lookup: the last n tokens (n from prompt_lookup_max down to prompt_lookup_min) found
    earlier in the sequence's tokens (prompt + output); the tokens that followed their latest
    earlier occurrence are the proposal. Pure numpy, over the resolved tokens only.

    The proposal copies the sequence from `shift` tokens back (shift = the distance between the
    occurrence and the end). Where fewer than k tokens follow the occurrence (a loop shorter than
    k: the latest occurrence of a period-2 loop's last tokens ends 2 tokens back), the copy goes on
    through the tokens it has just proposed, so a loop of period `shift` is proposed k tokens long:
    token i of the proposal is the token at start + (i mod shift)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.max_n, self.min_n = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, token_ids: list[int] | np.ndarray, max_tokens: int) -> list[int]:
        k = min(self.k, max_tokens)
        if k <= 0 or len(token_ids) < self.min_n + 1:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        # where an earlier occurrence could end: the last token seen before (with a token after it)
        ends = np.flatnonzero(ids[:-1] == ids[-1])
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            j = ends[ends >= n - 1]
            for back in range(1, n):  # the n-gram's earlier tokens match too
                j = j[ids[j - back] == ids[-1 - back]]
            if j.size:
                start = int(j[-1]) + 1  # the latest occurrence; the proposal is what followed it
                shift = len(ids) - start  # >= 1: the occurrence ends before the last token
                return [int(ids[start + i % shift]) for i in range(k)]
        return []


@dataclass
class SpecDecodeStats:
    """Counters (vLLM v1's SpecDecodingStats): `num_drafts` verification rows, `num_draft_tokens`
    proposals verified, `num_accepted_tokens` accepted, `accepted_per_pos[i]` accepted at
    proposal position i (so accepted_per_pos[0] <= num_drafts and each position <= the one before)."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


class Backoff:
    """Speculation turns itself down where it does not pay. Each step that proposes is scored by
    its acceptance (accepted / proposed, 0 when no sequence found a proposal); an exponential
    average below FLOOR switches proposing off for `backoff` steps, doubling each time up to
    MAX_BACKOFF, and one good step resets it. Off, a step is a plain decode step and, with async
    scheduling, the engine runs ahead again (core.py drains the step in flight only for a step
    that proposes). Exactness does not depend on it: it only chooses when to propose."""

    FLOOR = 0.1
    MAX_BACKOFF = 64
    WEIGHT = 0.5  # of the newest step in the average

    def __init__(self) -> None:
        self.average = 1.0  # optimistic: the first steps propose
        self.backoff = 1
        self.off_steps = 0
        self._drafted = self._accepted = 0
        self._scored = False  # a step that proposed is resolved and not yet folded in

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self._drafted += num_drafted
        self._accepted += num_accepted
        self._scored = True

    def on(self) -> bool:
        """Whether the next step proposes (folds in what was resolved since the last call)."""
        if self._scored:
            rate = self._accepted / self._drafted if self._drafted else 0.0
            self.average = (1 - self.WEIGHT) * self.average + self.WEIGHT * rate
            self._drafted = self._accepted = 0
            self._scored = False
            if self.average < self.FLOOR:
                self.off_steps, self.backoff = self.backoff, min(2 * self.backoff, self.MAX_BACKOFF)
                self.average = self.FLOOR  # the step after the pause probes afresh
            elif rate >= self.FLOOR:
                self.backoff = 1
        return self.off_steps == 0

    def start_step(self) -> bool:
        """Called once per scheduled step: whether it proposes (a paused step counts down)."""
        if self.on():
            return True
        self.off_steps -= 1
        return False


class TokenArrays:
    """Sequences' token ids as numpy arrays, extended as they grow (a sequence's ids only grow
    while it runs: proposals never enter them), so a lookup does not convert its whole list each
    step. Entries not used for two steps in a row are dropped (finished or paused sequences)."""

    def __init__(self) -> None:
        self.current: dict[int, tuple[np.ndarray, int]] = {}
        self.previous: dict[int, tuple[np.ndarray, int]] = {}

    def end_step(self) -> None:
        self.previous, self.current = self.current, {}

    def ids(self, seq: Sequence) -> np.ndarray:
        toks = seq.token_ids
        m = len(toks)
        buf, n = self.current.get(seq.seq_id) or self.previous.get(seq.seq_id) or (np.zeros(0, np.int64), 0)
        if m < n or (n and buf[n - 1] != toks[n - 1]):
            n = 0  # rewritten: start again
        if m > len(buf):
            grown = np.empty(max(2 * len(buf), m + 64), dtype=np.int64)
            grown[:n] = buf[:n]
            buf = grown
        if m > n:
            buf[n:m] = toks[n:m]
        self.current[seq.seq_id] = (buf, m)
        return buf[:m]


class Speculator:
    """What the scheduler asks of speculation: proposals for a decoding sequence (bounded by its
    max_tokens, max_model_len and the step's token budget), whether this step proposes at all
    (Backoff), and the counters. With a draft model the proposals are PLACEHOLDERs at schedule
    time, as many as the bounds allow (up to k): the draft model fills them in before the step
    runs (spec_draft.py)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.proposer = NgramProposer(config)
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats(config.num_speculative_tokens)
        self.backoff = Backoff()
        self.arrays = TokenArrays()
        self._looked = self._found = False  # this step: a decoding sequence looked for proposals; one found some

    def may_propose(self, num_running: int) -> bool:
        """Whether the next step may propose: the batch is small enough and Backoff is not pausing."""
        return self.config.proposes_at(num_running) and self.backoff.on()

    def start_step(self, num_running: int) -> bool:
        """Whether the step being scheduled, over `num_running` running sequences, proposes: not
        above the config's disable_by_batch_size (Backoff's pause does not count down there), and
        not while Backoff pauses."""
        self._looked = self._found = False
        return self.config.proposes_at(num_running) and self.backoff.start_step()

    def end_step(self) -> None:
        """A step whose decoding sequences found no proposal at all is scored as no acceptance."""
        if self._looked and not self._found:
            self.backoff.record(0, 0)
        self.arrays.end_step()

    def propose(self, seq: Sequence, budget: int, kv: KVCacheManager) -> list[int]:
        """Proposals for `seq`, decoding with every token resolved, of a length such that every
        token the step may emit (the accepted run and one more) is within max_tokens and
        max_model_len and the step's tokens (1 + k') within `budget`; their slots allocated. A
        constrained sequence's proposals stop before the first token its grammar refuses. Empty
        where the pool has no room for them: proposals never preempt anything."""
        if seq.num_pending or seq.beam is not None or seq.forks or seq.num_computed_tokens != seq.num_tokens - 1:
            return []
        limit = min(
            budget - 1,
            seq.sampling_params.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        if limit <= 0:
            return []
        if self.config.uses_draft_model:
            # a grammar cannot check proposals not yet made: such a sequence decodes plainly
            drafts = [] if seq.grammar is not None else [PLACEHOLDER] * min(self.config.num_speculative_tokens, limit)
        else:
            drafts = self.proposer.propose(self.arrays.ids(seq), limit)
        self._looked = True
        if drafts and seq.grammar is not None:
            drafts = drafts[: grammar_prefix(seq.grammar, drafts)]
        self._found = self._found or bool(drafts)
        if drafts and not kv.allocate_slots(seq, 1 + len(drafts)):
            return []
        return drafts


def grammar_prefix(grammar: SequenceGrammar, drafts: list[int]) -> int:
    """How many leading proposals the grammar accepts in order (its state is left unchanged)."""
    return int(grammar.matcher.validate_tokens(drafts))
