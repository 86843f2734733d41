"""CUDA graphs for the draft model's single-token forwards (worker/draft_model.py).

A proposing step runs the draft k' + 1 times: the catch-up forward (after a verification step
usually one token per sequence) and k' single-token forwards. Eager, each is one launch per
kernel of every layer, which costs more than the draft's device time at small batch; so the
draft's decode forward is captured like the target's (cuda_graphs.DecodeGraphs, over the draft's
model and KV) for batches up to the most sequences a step proposes for (speculative_config's
disable_by_batch_size, at most max_num_seqs). A forward whose input ids are the previous
forward's argmax takes them on the device (`fix`), so the host waits only once per step, for the
proposals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedllm.worker.cuda_graphs import DecodeGraphs

if TYPE_CHECKING:
    from pagedllm.engine.kv_cache_groups import KVCacheGroup
    from pagedllm.model.decoder import DecoderForCausalLM


@dataclass
class DraftRows:
    """One draft decode forward's rows (cuda_graphs.DecodeRows): one token per sequence."""

    input_ids: np.ndarray  # ignored where the ids come from the device (`fix`)
    positions: np.ndarray
    slot_mapping: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray  # [B, max_blocks]
    group_tables: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # one group: none

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


@dataclass
class DraftGraphView:
    """The draft as DecodeGraphs' runner (runner_view.GraphRunner)."""

    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    model: DecoderForCausalLM
    kv_cache_groups: tuple[KVCacheGroup, ...]

    def fill_placeholders(self, input_ids: torch.Tensor, fix: Any) -> None:
        """fix: the rows' input ids on the device (the previous forward's argmax), or None."""
        if fix is not None:
            input_ids[: len(fix)] = fix


def draft_batch_limit(max_num_seqs: int, disable_by_batch_size: int | None) -> int:
    """The largest batch a draft forward runs: a step proposes only at most disable_by_batch_size
    running sequences (None: any batch, up to max_num_seqs)."""
    return max_num_seqs if disable_by_batch_size is None else max(1, min(max_num_seqs, disable_by_batch_size))


def replay(graphs: DecodeGraphs, rows: DraftRows, ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """The rows' greedy next tokens on the device, from one replay (ids: their input ids on the
    device, else rows.input_ids)."""
    logits = graphs.run(rows, ids)
    return logits[:, :vocab_size].argmax(dim=-1)
