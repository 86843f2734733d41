"""Penalties, logit_bias, bad words and allowed_token_ids applied to the logits on their device.

The host builds a `pagedllm.worker.logits_controls.LogitsControls` (its docstring states the
semantics); `ControlTensors.to_device` copies its two packed arrays (no host sync) and splits them
into views. `apply_logits_controls` then works in float32 on the rows that use a control only:

1. allowed_token_ids: the other ids of those rows get -inf;
2. additions: logit_bias values, -inf for the banned last token of a bad word;
3. penalties: counts of the output tokens by one scatter-add over a [P, V] buffer; a token seen in
   the prompt or the output is divided (logit > 0) or multiplied by repetition_penalty, then
   logit -= frequency * count + presence * (count > 0).

vLLM's order; -inf stays -inf through every later step, so a forbidden token is never drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.worker.logits_controls import LogitsControls


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
    logits: torch.Tensor, penalties: torch.Tensor, prompt_index: torch.Tensor, output_index: torch.Tensor,
    flags: tuple[bool, bool],
) -> torch.Tensor:
    """logits [P, V] float32 of the penalized rows -> penalized (a new tensor). flags:
    (any_repetition, any_presence_frequency), known on the host."""
    any_repetition, any_presence_frequency = flags
    p, v = logits.shape
    counts = torch.zeros(p * v, dtype=torch.float32, device=logits.device)
    counts.index_add_(0, output_index, torch.ones_like(output_index, dtype=torch.float32))
    counts = counts.view(p, v)
    in_output = counts > 0
    if any_repetition:
        seen = in_output.clone()
        seen.view(-1).index_fill_(0, prompt_index, True)
        rep = torch.where(seen, penalties[:, 2:3], 1.0)
        logits = torch.where(logits > 0, logits / rep, logits * rep)
    if any_presence_frequency:
        logits = logits - penalties[:, 1:2] * counts - penalties[:, 0:1] * in_output
    return logits


def apply_logits_controls(logits: torch.Tensor, c: ControlTensors) -> torch.Tensor:
    """logits [B, V] -> the controlled logits, float32: written in place when they already are,
    else in a float32 copy (the controls compute in float32, as vLLM's sampler)."""
    if logits.dtype != torch.float32:
        logits = logits.float()
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
        sub = logits.index_select(0, c.penalty_rows)
        flags = (c.any_repetition, c.any_presence_frequency)
        logits.index_copy_(0, c.penalty_rows, apply_penalties(sub, c.penalties, c.prompt_index, c.output_index, flags))
    return logits
