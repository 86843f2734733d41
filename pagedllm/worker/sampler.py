"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p, min_tokens, the token
controls (penalties, logit_bias, allowed_token_ids, bad words) and the structured-output bitmask.

Sampling uses the exponential-race trick, argmax(p / E) with E ~ Exp(1), which draws from p.

Two sources of noise; either way a seeded request's draw depends on its seed and the token's
position only (`pagedllm.ops.sampling.row_seeds` mixes all 64 bits of both), so it gets the
same tokens whatever else is in the batch:
- on CUDA, Philox keyed by the row seed (`SamplingTensors.seeds`). Without top-k, top-p or
  min-p in the batch, one fused kernel draws argmax(logits / T + Gumbel) in a single read of
  the logits; otherwise the same noise E feeds the torch path below.
- elsewhere (CPU), torch's generators: a seeded row draws from a generator the runner seeded
  with its row seed for this token (`SamplingTensors.generators`).

Before any of that, on every path (greedy rows too), in vLLM's order:
1. min_tokens: the (row, id) pairs of `SamplingTensors.min_tokens_mask` are set to -inf;
2. the token controls (`pagedllm.ops.logits_controls`; the rows that use one, in float32);
3. the structured-output bitmask (`pagedllm.ops.token_bitmask`): a token the grammar forbids is -inf.
A -inf logit is never drawn whatever the temperature, top-k, top-p or min-p (its probability is 0;
the fused kernel's score stays -inf). A batch with none of these pays nothing: each is None and
the step samples exactly as without them (the fused kernel included).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.ops.logits_controls import ControlTensors, apply_logits_controls
from pagedllm.worker.step_inputs import StepInputs


@dataclass
class SamplingTensors:
    """A step's sampling parameters on the device. The four per-row tensors are None when every row
    is greedy (`all_greedy`): `sample` then takes the argmax without them, and the step uploads nothing."""

    temperature: torch.Tensor | None  # [B] fp32, 0 for greedy rows
    top_k: torch.Tensor | None  # [B] int64 in [1, V], V when off
    top_p: torch.Tensor | None  # [B] fp32, 1 when off
    min_p: torch.Tensor | None  # [B] fp32
    generators: list  # per row: torch.Generator or None (when seeds is None)
    all_greedy: bool
    any_greedy: bool
    need_top_k_p: bool
    need_min_p: bool
    seeds: torch.Tensor | None = None  # [B] int64 Philox row seeds (CUDA); None: torch generators
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None  # ([M] rows, [M] ids) int64: -inf
    controls: ControlTensors | None = None  # penalties, logit_bias, allowed_token_ids, bad words
    token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None  # ([R] rows int64, [R, W] int32 bits)


def seeded_rows(inp: StepInputs) -> tuple[np.ndarray, np.ndarray]:
    """The sample rows of seeded requests and their row seeds for this token: the request's
    seed (any int64) mixed with the token's position, all 64 bits of both counting."""
    rows = np.array([i for i, s in enumerate(inp.seeds) if s is not None], dtype=np.int64)
    if rows.size == 0:
        return rows, rows
    from pagedllm.ops.sampling import row_seeds

    own = np.array([inp.seeds[i] for i in rows.tolist()], dtype=np.int64)
    return rows, row_seeds(own, inp.positions[inp.logits_indices][rows])


def torch_generators(inp: StepInputs, device: torch.device) -> list[torch.Generator | None]:
    """Per row: a generator seeded for this token with the row seed, or None (unseeded).

    Seeded afresh each token rather than kept per request: a CPU generator's mt19937 keys on
    32 bits only, so seeding it with the request's seed would make seeds that differ in their
    high bits draw alike; the mixed row seed carries all 64. The draw is then a function of
    (seed, position) alone, as on the Philox path, whatever the request's history."""
    gens: list[torch.Generator | None] = [None] * len(inp.seeds)
    rows, seeds = seeded_rows(inp)
    for row, seed in zip(rows.tolist(), seeds.tolist(), strict=True):
        gens[row] = torch.Generator(device=device).manual_seed(seed)
    return gens


def sampling_tensors(
    inp: StepInputs,
    vocab_size: int,
    device: torch.device,
    to_device: Callable[[np.ndarray], torch.Tensor],
    philox_rng: np.random.Generator | None,
    upload: Callable[[list[np.ndarray]], list[torch.Tensor]] | None = None,
) -> SamplingTensors:
    """One step's SamplingTensors. philox_rng: draws the unseeded rows' Philox seeds (CUDA);
    None samples with torch's generators instead. upload: puts several arrays on the device at
    once (the runner's one-copy staging); by default each goes through to_device."""
    temperature = inp.temperature
    all_greedy = bool((temperature == 0).all())
    per_row = [temperature, inp.top_k, inp.top_p, inp.min_p]
    if philox_rng is not None and not all_greedy:
        base = philox_rng.integers(0, 2**63 - 1, size=len(inp.seeds), dtype=np.int64)
        rows, own = seeded_rows(inp)
        base[rows] = own
        per_row.append(base)
    dev: list[torch.Tensor | None] = [None] * 4  # all greedy: `sample` reads none of them
    if not all_greedy:
        dev = list(upload(per_row) if upload is not None else [to_device(a) for a in per_row])
    seeds = dev[4] if len(dev) == 5 else None
    mask = inp.min_tokens_mask
    bits = inp.token_bitmask
    return SamplingTensors(
        temperature=dev[0],
        top_k=dev[1],
        top_p=dev[2],
        min_p=dev[3],
        generators=[] if seeds is not None or all_greedy else torch_generators(inp, device),
        all_greedy=all_greedy,
        any_greedy=bool((temperature == 0).any()),
        need_top_k_p=bool((inp.top_k < vocab_size).any() or (inp.top_p < 1).any()),
        need_min_p=bool((inp.min_p > 0).any()),
        seeds=seeds,
        min_tokens_mask=None if mask is None else (to_device(mask[0]), to_device(mask[1])),
        controls=None if inp.logits_controls is None else ControlTensors.to_device(inp.logits_controls, to_device),
        token_bitmask=None if bits is None else (to_device(bits[0]), to_device(bits[1])),
    )


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what top-k and top-p filter out; the other logits keep their values.

    Ascending sort: top-k masks the V - k lowest ranks, top-p the tokens whose mass at or below
    them is <= 1 - p, never the top one. A row with top_k == V and top_p == 1 masks nothing
    (an explicit condition, not the float sums: at V ~ 152k a float32 cumulative sum is off by
    more than 1 - p would tolerate), so it samples as it would alone.
    """
    v = logits.shape[-1]
    sorted_logits, idx = logits.sort(dim=-1)
    ranks = torch.arange(v, device=logits.device)
    mask = ranks[None, :] < (v - top_k)[:, None]
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    below = probs.cumsum(dim=-1)  # mass at or below each token
    cut = (below <= (1 - top_p)[:, None]) & (top_p < 1)[:, None]
    cut[:, -1] = False  # the top token always stays
    mask |= cut
    return logits.masked_fill(torch.empty_like(mask).scatter_(-1, idx, mask), float("-inf"))


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits: [B, V] -> token ids [B] (int64, on the logits' device).

    With a min_tokens mask, controls or a bitmask the logits are written in place (the runner's
    own buffer; with controls, a float32 copy of it unless it is float32 already)."""
    if t.min_tokens_mask is not None:
        rows, ids = t.min_tokens_mask
        logits[rows, ids] = float("-inf")  # a host scalar: no copy, no sync
    if t.controls is not None:
        logits = apply_logits_controls(logits, t.controls)
    if t.token_bitmask is not None:
        from pagedllm.ops.token_bitmask import apply_token_bitmask

        apply_token_bitmask(logits, *t.token_bitmask)
    if t.all_greedy:
        return logits.argmax(dim=-1)  # exact in any float dtype: no fp32 copy
    temperature, top_k, top_p, min_p = t.temperature, t.top_k, t.top_p, t.min_p
    assert temperature is not None and top_k is not None and top_p is not None and min_p is not None
    if t.seeds is not None and not (t.need_top_k_p or t.need_min_p):
        from pagedllm.ops.sampling import gumbel_sample

        return gumbel_sample(logits, temperature, t.seeds)
    logits = logits.float()
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / temp[:, None]
    if t.need_top_k_p:
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    if t.need_min_p:
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    if t.seeds is not None:
        from pagedllm.ops.sampling import exponential_noise

        noise = exponential_noise(t.seeds, probs.shape[-1])
    else:
        noise = torch.empty_like(probs).exponential_()
        for row, gen in enumerate(t.generators):
            if gen is not None:
                noise[row].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    if not t.any_greedy:
        return sampled
    return torch.where(temperature > 0, sampled, logits.argmax(dim=-1))
