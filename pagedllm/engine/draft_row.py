"""DraftRow: one sample row of a verification step (spec_decode.py), read where a Sequence is read.

A verification step of a sequence with proposals d_1 .. d_k' samples k' + 1 rows; row j draws the
token after d_1 .. d_j, so every logits control must see the sequence as if those were already
its output: min_tokens (the output index), penalties and bad words (the token history), the
grammar mask (the matcher advanced by them). Row 0 is the Sequence itself (its `draft_prefix` is
empty); rows 1 .. k' are DraftRows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.sequence import Sequence

if TYPE_CHECKING:
    from pagedllm.engine.structured_output import SequenceGrammar


class DraftRow:
    """The sequence `base` as if `drafts` (its first j proposals) were already its output."""

    def __init__(self, base: Sequence, drafts: tuple[int, ...]) -> None:
        self.base = base
        self.draft_prefix = drafts
        self.seq_id = base.seq_id
        self.sampling_params: SamplingParams = base.sampling_params
        self.num_prompt_tokens = base.num_prompt_tokens
        self.num_output_tokens = base.num_output_tokens + len(drafts)
        self.num_logprobs = base.num_logprobs
        self.num_pending = base.num_pending
        self.grammar: SequenceGrammar | None = base.grammar

    @property
    def token_ids(self) -> list[int]:
        return [*self.base.token_ids, *self.draft_prefix]


SampleRow = Sequence | DraftRow  # what one sample row of a step reads (row 0 of a verification: the Sequence)
