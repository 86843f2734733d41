"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p.

Sampling uses the exponential-race trick, argmax(p / E) with E ~ Exp(1), which draws from p.

Two sources of noise:
- on CUDA, Philox keyed by a per-row seed (`SamplingTensors.seeds`, see
  `pagedllm.ops.sampling.row_seeds`): a seeded request's row seed mixes its seed with the
  token's position, so it gets the same tokens whatever else is in the batch. Without top-k,
  top-p or min-p in the batch, one fused kernel draws argmax(logits / T + Gumbel) in a single
  read of the logits; otherwise the same noise E feeds the torch path below.
- elsewhere (CPU), torch's generators: rows with a seed draw from their own torch.Generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [B] fp32, 0 for greedy rows
    top_k: torch.Tensor  # [B] int64, vocab size when off
    top_p: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32
    generators: list  # per row: torch.Generator or None (when seeds is None)
    all_greedy: bool
    any_greedy: bool
    need_top_k_p: bool
    need_min_p: bool
    seeds: torch.Tensor | None = None  # [B] int64 Philox row seeds (CUDA); None: torch generators


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    mask = ranks[None, :] >= top_k[:, None]
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs
    mask |= cum_before > top_p[:, None]  # keeps at least the top token
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits: [B, V] -> token ids [B] (int64, on the logits' device)."""
    if t.all_greedy:
        return logits.argmax(dim=-1)  # exact in any float dtype: no fp32 copy
    if t.seeds is not None and not (t.need_top_k_p or t.need_min_p):
        from pagedllm.ops.sampling import gumbel_sample

        return gumbel_sample(logits, t.temperature, t.seeds)
    logits = logits.float()
    temp = torch.where(t.temperature > 0, t.temperature, torch.ones_like(t.temperature))
    scaled = logits / temp[:, None]
    if t.need_top_k_p:
        scaled = apply_top_k_top_p(scaled, t.top_k, t.top_p)
    probs = scaled.softmax(dim=-1)
    if t.need_min_p:
        probs = probs.masked_fill(probs < t.min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
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
    return torch.where(t.temperature > 0, sampled, logits.argmax(dim=-1))
