"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral): a replicated router picks each token's top-k
experts (Kernels.select_experts: softmax, the k largest, renormalised where the config says), and
the experts run as one fused kernel (Kernels.fused_moe: ops/fused_moe.py on CUDA, ops/moe_ref.py
elsewhere).

Tensor parallelism, as vLLM's default: every rank holds every expert, each a slice of its
intermediate dimension (gate/up rows, down columns), so the experts' output is a partial sum,
all-reduced once after them, like a row-parallel linear.

Checkpoints name the experts one by one (`mlp.experts.E.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.E.w1/w3/w2.weight`) or, as HF transformers 5 holds them in memory, packed
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); the loader maps each to
its place in the packed parameters with `expert_target`.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.parallel import ShardedModule, all_reduce, divide, tp_rank, tp_size
from pagedllm.ops.kernels import Kernels


def num_experts_of(cfg) -> int:
    return int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0)


def expert_intermediate_size(cfg, kind: str) -> int:
    """The experts' intermediate size: Qwen3-MoE's moe_intermediate_size (its dense layers use
    intermediate_size), Mixtral's intermediate_size."""
    return cfg.moe_intermediate_size if kind == "qwen3_moe" else cfg.intermediate_size


def intermediate_field(kind: str) -> str:
    return "moe_intermediate_size" if kind == "qwen3_moe" else "intermediate_size"


def is_moe_layer(cfg, kind: str | None, layer: int) -> bool:
    """HF's rule: Mixtral's every layer; Qwen3-MoE's layers not in mlp_only_layers whose index + 1
    is a multiple of decoder_sparse_step (when the model has experts at all)."""
    if kind is None:
        return False
    if kind == "mixtral":
        return True
    only_dense = getattr(cfg, "mlp_only_layers", None) or []
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return layer not in only_dense and num_experts_of(cfg) > 0 and (layer + 1) % step == 0


class FusedExperts(ShardedModule):
    """Every expert's weights in the kernel's layout: w13 [E, 2*I/tp, H] (gate rows, then up rows),
    w2 [E, H, I/tp]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, field: str):
        super().__init__()
        self.tp_rank = tp_rank()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.inter_per_rank = divide(intermediate, tp_size(), field)
        n = self.inter_per_rank
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * n, hidden), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, n), requires_grad=False)

    def num_shards(self, name: str) -> int:
        """How many per-expert checkpoint matrices fill parameter `name` (gate and up for w13's)."""
        return self.num_experts * (2 if name.startswith("w13") else 1)

    def run(self, kernels: Kernels, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] through each token's experts (ids, weights [T, k]) -> [T, H], this rank's partial sum."""
        return kernels.fused_moe(x, self.w13_weight, self.w2_weight, weights, ids)

    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        """shard_id 3 * expert + part (part 0 gate, 1 up, 2 down): one expert's matrix; None: the
        packed 3-D tensor of all experts (gate_up [E, 2I, H] for w13, down [E, H, I] for w2)."""
        n, r = self.inter_per_rank, self.tp_rank
        param = self.get_parameter(name).data
        if shard_id is None:
            if name == "w13_weight":
                gate, up = loaded.chunk(2, dim=1)
                param[:, :n].copy_(gate.narrow(1, r * n, n))
                param[:, n:].copy_(up.narrow(1, r * n, n))
            else:
                param.copy_(loaded.narrow(2, r * n, n))
            return
        expert, part = divmod(int(shard_id), 3)
        if expert >= self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}; the config has {self.num_experts} experts")
        if part == 2:
            param[expert].copy_(loaded.narrow(1, r * n, n))
        else:
            param[expert, part * n : (part + 1) * n].copy_(loaded.narrow(0, r * n, n))


class SparseMoeBlock(nn.Module):
    """x [T, H] -> sum over the token's top-k experts of weight * expert(x), all-reduced under TP."""

    def __init__(self, cfg, kind: str, kernels: Kernels):
        super().__init__()
        self.kernels = kernels
        self.kind = kind  # "qwen3_moe" or "mixtral": how the checkpoint names the experts
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = kind == "mixtral" or bool(getattr(cfg, "norm_topk_prob", False))
        self.round_weights = kind == "qwen3_moe"  # HF's Qwen3-MoE rounds the weights to the model dtype
        e = num_experts_of(cfg)
        self.gate = nn.Linear(cfg.hidden_size, e, bias=False)  # the router, replicated on every rank
        self.gate.weight.requires_grad_(False)
        inter = expert_intermediate_size(cfg, kind)
        self.experts: FusedExperts = FusedExperts(e, cfg.hidden_size, inter, intermediate_field(kind))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate.weight)
        weights, ids = self.kernels.select_experts(logits, self.top_k, self.renormalize, self.round_weights)
        y = self.experts.run(self.kernels, x, weights, ids)
        return all_reduce(y)


_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*)\.(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.(?P<leaf>weight|weight_scale|weight_scale_inv)$"
)
_PACKED = re.compile(
    r"^(?P<prefix>.*)\.(?:mlp|block_sparse_moe)\.experts\.(?P<proj>gate_up_proj|down_proj)(?:\.weight)?$"
)
_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


def expert_target(name: str) -> tuple[str, int | None] | None:
    """A checkpoint name of the experts or the router -> (the model's parameter, shard id for
    FusedExperts.load_weight: 3 * expert + part, None for a packed tensor or the router); None for
    any other name. An FP8 expert's `weight_scale` (`weight_scale_inv`) goes to w13_weight_scale or
    w2_weight_scale (model/moe_quant.py)."""
    m = _PER_EXPERT.match(name)
    if m:
        part = _PART[m["proj"]]
        param = ("w2_" if part == 2 else "w13_") + m["leaf"].removesuffix("_inv")  # FP8: the block multipliers
        return f"{m['prefix']}.mlp.experts.{param}", 3 * int(m["e"]) + part
    m = _PACKED.match(name)
    if m:
        param = "w13_weight" if m["proj"] == "gate_up_proj" else "w2_weight"
        return f"{m['prefix']}.mlp.experts.{param}", None
    if ".block_sparse_moe.gate." in name:  # Mixtral's router
        return name.replace(".block_sparse_moe.", ".mlp."), None
    return None


def check_tp(cfg, kind: str | None, n: int) -> None:
    """Every rank holds a slice of each expert's intermediate dimension: n must divide it."""
    if kind is None or n == 1 or not any(is_moe_layer(cfg, kind, i) for i in range(cfg.num_hidden_layers)):
        return
    field = intermediate_field(kind)
    size = expert_intermediate_size(cfg, kind)
    if size % n:
        raise ValueError(
            f"tensor_parallel_size={n} must divide the experts' {field} ({size}): each rank holds a slice of "
            "every expert's intermediate dimension"
        )
