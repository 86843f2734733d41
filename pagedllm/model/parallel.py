"""Tensor-parallel state: which rank this process is and how to reduce across ranks.

With no process group (the usual single-device case) every helper is the identity, so the
layers are written rank-aware once and run unchanged at TP=1. The tensor-parallel group is
torch.distributed's default group, which worker/tp_executor.py initialises (one group of all
ranks); nothing here keeps state of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard of the last dimension on every rank."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


class ShardedModule(nn.Module):
    """A layer whose parameters hold this rank's slice of checkpoint tensors. The loader
    (loader.py) hands each checkpoint tensor to the layer that owns the parameter."""

    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: int | str | None) -> None:
        """Copy this rank's part of `loaded` (for packed parameters: of shard `shard_id`) into
        parameter `name` of this layer."""
        raise NotImplementedError


def divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


def agree_min(n: int) -> int:
    """The smallest n over the ranks (e.g. KV blocks: every rank must index the same block ids)."""
    if tp_size() == 1:
        return n
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def agree_max(values: list[float]) -> list[float]:
    """The elementwise largest of `values` over the ranks (e.g. the measured K/V ranges that size
    an fp8 cache's scales: every rank then stores its heads with the same scales as TP=1 would)."""
    if tp_size() == 1:
        return list(values)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
