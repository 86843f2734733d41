"""Mixture-of-experts in plain torch: the router's top-k selection (used on every device) and the
experts' computation, the reference of the fused Triton kernel (fused_moe.py) and the CPU path.

Layout (the kernel's, packed by the loader): w13 [E, 2*I, H] holds each expert's gate rows then
its up rows; w2 [E, H, I] its down projection. With tensor parallelism I is this rank's slice.
"""

from __future__ import annotations

import torch


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, round_weights: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> (weights [T, k] float32, expert ids [T, k] int32), as HF computes
    them: softmax in float32 over all experts, the k largest, optionally divided by their sum
    (Qwen3-MoE's norm_topk_prob; Mixtral always); round_weights: rounded to the logits' dtype
    (HF's Qwen3-MoE; a no-op in float32)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_weights:
        weights = weights.to(router_logits.dtype).float()
    return weights, ids.to(torch.int32)


def fused_moe_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """x [T, H] -> sum over each token's k experts of weight * down(silu(gate(x)) * up(x)), [T, H]
    in x's dtype. Each expert runs once on the tokens routed to it (HF's loop); the weighted
    outputs are summed in float32 and rounded once."""
    t, h = x.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    for e in torch.unique(flat_ids).tolist():
        rows = (flat_ids == e).nonzero().squeeze(1)  # positions in the [T * k] flattening
        tokens = rows // topk_ids.shape[1]
        gate_up = x[tokens] @ w13[e].t()
        act = torch.nn.functional.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()
        y = act.to(x.dtype) @ w2[e].t()
        out.index_add_(0, tokens, y.float() * topk_weights.reshape(-1)[rows, None].float())
    return out.to(x.dtype)


def padded_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case length of the sorted, padded pair list: every non-empty expert (at most
    min(E, pairs) of them) adds up to block_m - 1 rows of padding; rounded up to block_m."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align_block_size_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids [P] int32: pair indices (token * k + slot) grouped by expert,
    each group padded with the sentinel T * k to a multiple of block_m; expert_ids [P / block_m]
    int32: each block's expert; num_padded [1] int32: the used length of sorted_ids). P is
    padded_size(T * k, ...); blocks past num_padded are never read. Torch ops on the device, no host
    synchronisation; the reference of fused_moe.moe_align_block_size (two Triton launches)."""
    flat = topk_ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # the pairs by expert, in token order within one
    expert_of = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[expert_of]
    size = padded_size(n, num_experts, block_m)
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, (ends - padded)[expert_of] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, size, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)
