"""Penalties, logit_bias, bad words and allowed_token_ids applied to the logits on their device.

The host builds a `LogitsControls` (below; its docstring states the semantics;
`pagedllm.worker.logits_controls` builds it from the step's sequences); `ControlTensors.to_device` copies its two packed arrays (no host sync) and splits them
into views. `apply_logits_controls` then works in float32 on the rows that use a control only:

1. allowed_token_ids: the other ids of those rows get -inf;
2. additions: logit_bias values, -inf for the banned last token of a bad word;
3. penalties, by gathers and scatters over the history ids (no [P, V] buffer): a token seen in
   the prompt or the output is divided (logit > 0) or multiplied by repetition_penalty, then
   logit -= frequency * count + presence * (count > 0), count over the output.

vLLM's order; -inf stays -inf through every later step, so a forbidden token is never drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch


@dataclass
class LogitsControls:
    """The controls of one step's sample rows. V = vocab_size, the logits' width; a flat index
    i * V + id names token id of the i-th row of a section."""

    vocab_size: int
    # penalties: P rows, their (presence, frequency, repetition), the token ids they count
    penalty_rows: np.ndarray  # [P] int64 sample rows
    penalties: np.ndarray  # [P, 3] float32
    prompt_index: np.ndarray  # [Np] int64 flat index: prompt tokens of the rows with repetition != 1
    output_index: np.ndarray  # [No] int64 flat index: output tokens, once per occurrence (counts)
    any_repetition: bool
    any_presence_frequency: bool
    # logit_bias and bad words as additions: bias values, -inf for a banned token
    add_rows: np.ndarray  # [N] int64 sample rows
    add_ids: np.ndarray  # [N] int64
    add_values: np.ndarray  # [N] float32
    # allowed_token_ids: A rows, each keeping only the ids of its flat indexes
    allowed_rows: np.ndarray  # [A] int64 sample rows
    allowed_index: np.ndarray  # [M] int64 flat index

    INT_FIELDS: ClassVar[tuple[str, ...]] = (
        "penalty_rows",
        "prompt_index",
        "output_index",
        "add_rows",
        "add_ids",
        "allowed_rows",
        "allowed_index",
    )

    def int_sizes(self) -> list[int]:
        return [len(getattr(self, f)) for f in self.INT_FIELDS]

    def packed(self) -> tuple[np.ndarray, np.ndarray]:
        """(every int64 section concatenated in INT_FIELDS order, penalties.ravel() then add_values):
        the two arrays a step copies to the device."""
        ints = np.concatenate([getattr(self, f) for f in self.INT_FIELDS])
        floats = np.concatenate([self.penalties.ravel(), self.add_values]).astype(np.float32, copy=False)
        return ints, floats


@dataclass
class ControlTensors:
    """LogitsControls on the device: the same fields (views of two packed tensors) and flags."""

    vocab_size: int
    penalty_rows: torch.Tensor
    penalties: torch.Tensor  # [P, 3] float32: presence, frequency, repetition
    prompt_index: torch.Tensor
    output_index: torch.Tensor
    any_repetition: bool
    any_presence_frequency: bool
    add_rows: torch.Tensor
    add_ids: torch.Tensor
    add_values: torch.Tensor
    allowed_rows: torch.Tensor
    allowed_index: torch.Tensor

    @staticmethod
    def to_device(c: LogitsControls, to_device: Callable[[np.ndarray], torch.Tensor]) -> ControlTensors:
        ints, floats = c.packed()
        ints_t, floats_t = to_device(ints), to_device(floats)
        parts = dict(zip(LogitsControls.INT_FIELDS, ints_t.split(c.int_sizes()), strict=True))
        p = len(c.penalty_rows)
        return ControlTensors(
            vocab_size=c.vocab_size,
            penalties=floats_t[: 3 * p].view(p, 3),
            add_values=floats_t[3 * p :],
            any_repetition=c.any_repetition,
            any_presence_frequency=c.any_presence_frequency,
            **parts,
        )


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    penalties: torch.Tensor,
    prompt_index: torch.Tensor,
    output_index: torch.Tensor,
    flags: tuple[bool, bool],
) -> None:
    """logits [B, V] float32 contiguous, in place: the penalized sample rows `rows` [P], their
    (presence, frequency, repetition) [P, 3]. flags: (any_repetition, any_presence_frequency),
    known on the host.

    Work in proportion to the tokens of the histories, not to P * V: every step gathers the
    logits of the history ids, transforms them and scatters them back. An id occurring several
    times is written several times with the same value (each computed from the same gathered
    logit), so plain scatters are exact; only frequency accumulates, once per occurrence."""
    v = logits.shape[-1]
    flat = logits.view(-1)

    def target(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.div(index, v, rounding_mode="floor")  # the penalized row of each index
        return rows[p] * v + (index - p * v), p

    out_at, out_row = target(output_index)
    if flags[0]:
        prompt_at, prompt_row = target(prompt_index)
        at, row = torch.cat([prompt_at, out_at]), torch.cat([prompt_row, out_row])
        x, r = flat[at], penalties[row, 2]
        flat[at] = torch.where(x > 0, x / r, x * r)
    if flags[1]:
        flat[out_at] = flat[out_at] - penalties[out_row, 0]  # presence: once per distinct id
        flat.index_add_(0, out_at, -penalties[out_row, 1])  # frequency: once per occurrence


def apply_logits_controls(logits: torch.Tensor, c: ControlTensors) -> torch.Tensor:
    """logits [B, V] -> the controlled logits, float32: written in place when they already are,
    else in a float32 copy (the controls compute in float32, as vLLM's sampler)."""
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        logits = logits.float().contiguous()
    v = logits.shape[-1]
    assert v == c.vocab_size, (v, c.vocab_size)
    if len(c.allowed_rows):
        keep = torch.zeros(len(c.allowed_rows) * v, dtype=torch.bool, device=logits.device)
        keep.index_fill_(0, c.allowed_index, True)
        sub = logits.index_select(0, c.allowed_rows).masked_fill_(~keep.view(-1, v), float("-inf"))
        logits.index_copy_(0, c.allowed_rows, sub)
    if len(c.add_rows):
        logits.index_put_((c.add_rows, c.add_ids), c.add_values, accumulate=True)
    if len(c.penalty_rows):
        flags = (c.any_repetition, c.any_presence_frequency)
        apply_penalties(logits, c.penalty_rows, c.penalties, c.prompt_index, c.output_index, flags)
    return logits
