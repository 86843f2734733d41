"""Mixture-of-experts in plain torch: the router's top-k selection (used on every device) and the
experts' computation, the reference of the fused Triton kernel (fused_moe.py) and the CPU path.

Layout (the kernel's, packed by the loader): w13 [E, 2*I, H] holds each expert's gate rows then
its up rows; w2 [E, H, I] its down projection. With tensor parallelism I is this rank's slice.
"""

from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> (weights [T, k] float32, expert ids [T, k] int32), as HF computes
    them: softmax in float32 over all experts, the k largest, optionally divided by their sum
    (Qwen3-MoE's norm_topk_prob; Mixtral always)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
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
