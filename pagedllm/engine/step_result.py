"""What a step returns to the engine: the sampled ids and the logprobs asked for.

Plain data that both sides of the executor boundary import (engine/executor.py's protocol, the
scheduler and the sequences that consume it, the workers that fill it), in a module of its own
so that neither side imports the other for it (as vLLM v1's `outputs.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class TokenLogprobs(NamedTuple):
    """One scored token: `token_ids[0]` is the token itself (sampled, or the prompt's next token),
    `token_ids[1:]` the top k of the distribution, best first; `logprobs` the log-softmax of the
    model's raw float32 logits at those ids; `rank` the token's rank (1 = the most likely; ties
    count against it: the number of ids whose logprob is >= its own)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class PromptLogprobsChunk:
    """Prompt logprobs a step computed for one sequence: entry j scores prompt token `start + j`
    (start >= 1: the first prompt token has no logprob), given the tokens before it."""

    start: int
    entries: list[TokenLogprobs]


@dataclass
class StepResult:
    sampled: list[int]  # one per sample row
    logprobs: list[TokenLogprobs | None] | None = None  # per sample row (None: that row did not ask); None: none did
    prompt_logprobs: dict[int, PromptLogprobsChunk] | None = None  # seq_id -> this step's chunk
    kv_load_seconds: float = 0.0  # device time of the step's host-tier loads (engine/host_tier.py)
