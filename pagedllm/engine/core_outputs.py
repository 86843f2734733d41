"""EngineCoreOutput assembly: what the core sends for a sequence after a step (messages.py).

EngineCore (core.py) keeps the request bookkeeping (which index a sequence has, when a request is
done, the token counters); these functions only build the messages, so which fields go out when
is written in one place: a resolved sequence's new tokens (its finish fields once, when it has
finished; its prompt logprobs once, with its first token), a sequence ended by a grammar that
failed to compile (no token, the compiler's message), and a finished beam search's hypotheses.
"""

from __future__ import annotations

import time

from pagedllm.engine.beam_search import BeamSearch
from pagedllm.engine.messages import EngineCoreOutput
from pagedllm.engine.sequence import Sequence
from pagedllm.engine.step_result import TokenLogprobs


def token_output(
    seq: Sequence, index: int, tokens: list[int], logprobs: list[TokenLogprobs | None] | None, first: bool
) -> EngineCoreOutput:
    """The tokens a step resolved for the sequence at `index` of its request; `first`: they are
    its first output tokens (its prompt logprobs go with them, where it asked)."""
    out = EngineCoreOutput(
        seq.request_id,
        index,
        tokens,
        None,
        None,
        seq.num_cached_tokens,
        seq.first_token_time,
        None,
        None if logprobs is None else [x for x in logprobs if x is not None] or None,
        seq.prompt_logprobs if first and seq.sampling_params.prompt_logprobs is not None else None,
    )
    if seq.status.finished:  # the finish fields only once (the core calls this per resolved token run)
        out.finish_reason, out.stop_reason, out.finish_time = (
            seq.finish_reason,
            seq.stop_reason,
            seq.finish_time,
        )
        out.stop_token = seq.stopped_on_token
    return out


def grammar_failure_output(seq: Sequence, index: int, why: str) -> EngineCoreOutput:
    """A sequence the scheduler ended because its grammar failed to compile: no token,
    finish_reason "error" and llguidance's message."""
    error = f"structured_outputs cannot be compiled: {why}"
    return EngineCoreOutput(seq.request_id, index, [], seq.finish_reason, None, 0, None, seq.finish_time, error=error)


def beam_outputs(search: BeamSearch[Sequence], first: Sequence) -> list[EngineCoreOutput]:
    """A finished search's outputs: one per returned hypothesis, best first (index = rank);
    `first`: the sequence that computed the prompt (its cached tokens and first token time)."""
    now = time.monotonic()
    return [
        EngineCoreOutput(
            search.request_id,
            rank,
            hyp.token_ids,
            hyp.finish_reason,
            None,
            first.num_cached_tokens,
            first.first_token_time,
            now,
            cumulative_logprob=hyp.cumulative_logprob,
            score=hyp.score,
        )
        for rank, hyp in enumerate(search.results())
    ]
