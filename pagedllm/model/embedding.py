"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.parallel import ShardedModule, all_reduce, gather_last_dim, tp_rank, tp_size


class VocabParallelEmbedding(ShardedModule):
    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.tp_size, self.tp_rank = tp_size(), tp_rank()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // self.tp_size)  # last rank padded
        self.start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden), requires_grad=False)

    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        part = loaded[self.start : self.start + self.per_rank]
        self.get_parameter(name).data[: part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local >= 0) & (local < self.per_rank)
        y = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = gather_last_dim(logits)
        return logits[..., : self.vocab_size]
