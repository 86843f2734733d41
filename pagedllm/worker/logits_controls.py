"""A step's token controls, built on the host with numpy: penalties, logit_bias, allowed_token_ids
and bad words (vLLM's semantics; the device side is `pagedllm.ops.logits_controls`).

- repetition_penalty r: a token seen in the prompt or the output so far has its logit divided by
  r when it is > 0, multiplied by r otherwise (HF's RepetitionPenaltyLogitsProcessor).
- frequency_penalty f, presence_penalty p (OpenAI's): logit -= f * count + p * (count > 0), the
  count over the output tokens only.
- logit_bias: added to the logits. allowed_token_ids: every other id gets -inf.
- bad words (`SamplingParams.bad_words_token_ids`): a word of one token is always banned; a word
  of k > 1 tokens bans its last token when the output so far ends with its first k - 1 (the output
  only, not the prompt, as vLLM).

Only the sample rows that use a control are in a LogitsControls; a step where none does has none
(None in StepInputs) and samples exactly as before. Its arrays are plain numpy (StepInputs is
pickled to the other tensor-parallel ranks) and travel to the device as two packed arrays, one
int64 and one float32 (`packed`), split there by the lengths recorded here.

The token history of penalized rows and of rows with a multi-token bad word (the rows of
`SamplingParams.needs_output_history`) comes from a TokenHistory kept across steps: a decode step
appends one id per sequence instead of converting its whole list again. Such a sequence is never
scheduled with a PLACEHOLDER pending (async scheduling waits for its in-flight token), and
TokenHistory asserts it: a penalty over an unknown token would be silently wrong.
"""

from __future__ import annotations

import numpy as np

from pagedllm.engine.draft_row import DraftRow, SampleRow
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.scheduler_output import PLACEHOLDER
from pagedllm.ops.logits_controls import LogitsControls

_NO_IDS = np.zeros(0, dtype=np.int64)


def uses_logits_controls(p: SamplingParams) -> bool:
    return bool(p.uses_penalties or p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids)


class TokenHistory:
    """The token ids (prompt + output) of sequences as numpy arrays, kept from step to step.

    Each call appends the ids a sequence gained since the last (a decode step: one). An entry not
    asked for during two builds with controls in a row is dropped (a sequence that finished or left the batch);
    two, not one, so a sequence scheduled every other step (async scheduling waits for its token)
    keeps its array."""

    def __init__(self) -> None:
        self.current: dict[int, tuple[np.ndarray, int]] = {}  # seq_id -> (buffer, valid length)
        self.previous: dict[int, tuple[np.ndarray, int]] = {}

    def end_step(self) -> None:
        self.previous, self.current = self.current, {}

    def ids(self, seq: SampleRow) -> np.ndarray:
        """[seq.num_tokens] int64, the sequence's ids now (a view into the kept buffer); a DraftRow's
        are its sequence's and its proposals (a copy: proposals never enter the kept buffer)."""
        if isinstance(seq, DraftRow):
            return np.concatenate([self.ids(seq.base), np.asarray(seq.draft_prefix, dtype=np.int64)])
        sid = seq.seq_id
        buf, n = self.current.get(sid) or self.previous.get(sid) or (_NO_IDS, 0)
        toks = seq.token_ids
        m = len(toks)
        if m < n or (n and buf[n - 1] != toks[n - 1]):  # the list was rewritten: start again
            n = 0
        if m > len(buf):
            grown = np.empty(max(2 * len(buf), m + 64), dtype=np.int64)
            grown[:n] = buf[:n]
            buf = grown
        if m > n:
            new = np.fromiter(toks[n:m], dtype=np.int64, count=m - n)
            assert not (new == PLACEHOLDER).any(), (
                f"sequence {sid} is sampled with a pending PLACEHOLDER token in its history: its penalties or "
                "bad words need every earlier id (the scheduler must wait for its in-flight token)"
            )
            buf[n:m] = new
        self.current[sid] = (buf, m)
        return buf[:m]


def _flat(parts: list[np.ndarray], vocab_size: int) -> np.ndarray:
    """The flat indexes i * V + id of parts[i]'s ids; ids outside [0, V) are left out."""
    if not parts:
        return _NO_IDS
    ids = np.concatenate(parts)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):  # rare: a boolean index is slow
        parts = [p[(p >= 0) & (p < vocab_size)] for p in parts]
        ids = np.concatenate(parts)
    flat = np.repeat(np.arange(len(parts), dtype=np.int64) * vocab_size, [len(p) for p in parts])
    flat += ids
    return flat


def _bad_word_bans(seq: SampleRow, history: TokenHistory) -> list[int]:
    """The ids seq may not draw now: the last token of each bad word whose other tokens end the output."""
    words = seq.sampling_params.bad_words_token_ids or []
    out = None
    banned: list[int] = []
    for w in words:
        if len(w) == 1:
            banned.append(w[0])
            continue
        if out is None:
            out = history.ids(seq)[seq.num_prompt_tokens :]
        k = len(w) - 1
        if len(out) >= k and out[-k:].tolist() == w[:-1]:
            banned.append(w[-1])
    return banned


def build_logits_controls(sampled: list[SampleRow], vocab_size: int, history: TokenHistory) -> LogitsControls | None:
    """The controls of the sample rows `sampled` (row i samples for sampled[i]); None when no row
    uses one. Called before `Scheduler.advance`: a sequence's ids are the ones before the token
    drawn now."""
    v = vocab_size
    pen_rows: list[int] = []
    pens: list[tuple[float, float, float]] = []
    prompts: list[np.ndarray] = []
    outputs: list[np.ndarray] = []
    add_rows: list[int] = []
    add_ids: list[int] = []
    add_values: list[float] = []
    allowed_rows: list[int] = []
    allowed: list[np.ndarray] = []
    for row, seq in enumerate(sampled):
        p = seq.sampling_params
        if not uses_logits_controls(p):
            continue
        if p.uses_penalties:
            ids = history.ids(seq)
            pen_rows.append(row)
            pens.append((p.presence_penalty, p.frequency_penalty, p.repetition_penalty))
            prompts.append(ids[: seq.num_prompt_tokens] if p.repetition_penalty != 1 else _NO_IDS)
            outputs.append(ids[seq.num_prompt_tokens :])
        if p.logit_bias:
            for tid, b in p.logit_bias.items():
                if tid < v:
                    add_rows.append(row)
                    add_ids.append(tid)
                    add_values.append(b)
        if p.bad_words_token_ids:
            for tid in _bad_word_bans(seq, history):
                if tid < v:
                    add_rows.append(row)
                    add_ids.append(tid)
                    add_values.append(float("-inf"))
        if p.allowed_token_ids:
            allowed_rows.append(row)
            allowed.append(np.asarray(p.allowed_token_ids, dtype=np.int64))
    history.end_step()
    if not (pen_rows or add_rows or allowed_rows):
        return None  # e.g. only multi-token bad words, none of them completable now
    pen = np.array(pens, dtype=np.float32).reshape(-1, 3)
    return LogitsControls(
        vocab_size=v,
        penalty_rows=np.array(pen_rows, dtype=np.int64),
        penalties=pen,
        prompt_index=_flat(prompts, v),
        output_index=_flat(outputs, v),
        any_repetition=bool((pen[:, 2] != 1).any()),
        any_presence_frequency=bool((pen[:, :2] != 0).any()),
        add_rows=np.array(add_rows, dtype=np.int64),
        add_ids=np.array(add_ids, dtype=np.int64),
        add_values=np.array(add_values, dtype=np.float32),
        allowed_rows=np.array(allowed_rows, dtype=np.int64),
        allowed_index=_flat(allowed, v),
    )
