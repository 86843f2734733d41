"""When a sequence stops after a token it was given (Scheduler.resolve asks once per token, in
order, also inside an accepted speculative run, whose later tokens are then dropped).

Order: the grammar first (structured output), then EOS and stop token ids (once min_tokens are
out), then max_tokens and max_model_len. Stop strings are the output processor's (text)."""

from __future__ import annotations

from pagedllm.engine.sequence import Sequence, SequenceStatus


def stop_status(
    seq: Sequence, token: int, num_tokens: int, eos_token_ids: frozenset[int], max_model_len: int
) -> SequenceStatus | None:
    """Stop after `token`, the sequence's num_tokens-th token? Sets stop_reason / stopped_on_token."""
    if seq.grammar is not None:
        status = grammar_stop(seq, token, eos_token_ids)
        if status is not None:
            return status
    p = seq.sampling_params
    num_output = num_tokens - seq.num_prompt_tokens
    if num_output >= p.min_tokens:
        if not p.ignore_eos and token in eos_token_ids:
            seq.stop_reason, seq.stopped_on_token = None, True
            return SequenceStatus.FINISHED_STOPPED
        if p.stop_token_ids and token in p.stop_token_ids:
            seq.stop_reason, seq.stopped_on_token = token, True
            return SequenceStatus.FINISHED_STOPPED
    if num_output >= p.max_tokens or num_tokens >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH
    return None


def grammar_stop(seq: Sequence, token: int, eos_token_ids: frozenset[int]) -> SequenceStatus | None:
    """Advance the sequence's matcher by its new token. A complete grammar ends the sequence
    ("stop", also with ignore_eos and before min_tokens: nothing else could follow). A token
    the grammar refuses means the mask was not applied: the sequence ends, aborted (logged)."""
    assert seq.grammar is not None
    if not seq.grammar.accept(token):
        return SequenceStatus.FINISHED_ABORTED
    if seq.grammar.is_stopped:  # the last token is the grammar's (its text is shown), or EOS
        seq.stop_reason, seq.stopped_on_token = None, token in eos_token_ids
        return SequenceStatus.FINISHED_STOPPED
    return None
