"""CUDA graphs for decode-only steps.

At start-up the decode forward (model + LM head) is captured once per batch size of a
ladder (1, 2, 4, 8, 16, 32, 48, ... up to max_num_seqs). A step of B sequences copies its
inputs into the static buffers, pads to the next captured size (padding rows store nothing:
slot PAD_SLOT_ID) and replays. All graphs share one memory pool. The AttentionMetadata a graph
was captured with views the static buffers, so a replay reads the step's copied-in values, the
launch order of decode attention (the batch longest first) among them.
Each KV-cache group after the first has its own slot-mapping and block-table buffers.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from pagedllm import envs
from pagedllm.ops import PAD_SLOT_ID
from pagedllm.ops.attention_metadata import AttentionMetadata, longest_first

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from pagedllm.worker.runner_view import GraphRunner


class DecodeRows(Protocol):
    """What a replay reads of a decode step: one row per sequence (StepInputs is one; the draft
    model's single-token forwards build their own, worker/draft_model.py)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    group_tables: list[tuple[np.ndarray, np.ndarray]]

    @property
    def num_seqs(self) -> int: ...


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, runner: GraphRunner):
        self.runner = runner
        dev = runner.device
        self.sizes = batch_size_ladder(runner.max_num_seqs)
        max_bs = self.sizes[-1]
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_bs,), PAD_SLOT_ID, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(max_bs, self.max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.seq_order = torch.arange(max_bs, dtype=torch.int32, device=dev)  # decode attention's launch order
        self.ordered = envs.decode_launch_order() == "longest"
        self.num_groups = len(runner.kv_cache_groups)
        self.group_slots = [torch.full_like(self.slot_mapping, PAD_SLOT_ID) for _ in range(1, self.num_groups)]
        self.group_tables = [torch.zeros_like(self.block_tables) for _ in range(1, self.num_groups)]
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        # Pinned staging, so a step's inputs go up in one copy per array. Two sets, used in
        # turn: with async scheduling step N+1 is written on the host while step N's copies
        # may still wait in the stream behind step N-1 (writing into the same set would change
        # step N's inputs, placeholders included, under it). The event guards the reuse.
        self.host = [
            {
                name: torch.zeros(t.shape, dtype=t.dtype).pin_memory()
                for name, t in (
                    ("input_ids", self.input_ids),
                    ("positions", self.positions),
                    ("slot_mapping", self.slot_mapping),
                    ("seq_lens", self.seq_lens),
                    ("seq_order", self.seq_order),
                    ("block_tables", self.block_tables),
                    *((f"slot_mapping{g}", t) for g, t in enumerate(self.group_slots, 1)),
                    *((f"block_tables{g}", t) for g, t in enumerate(self.group_tables, 1)),
                )
            }
            for _ in range(2)
        ]
        self.copied = [torch.cuda.Event(), torch.cuda.Event()]  # per set: after its copies
        self.turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool: _POOL_HANDLE | None = None
        self._capture_all()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            max_seqlen_q=1,
            max_seqlen_k=self.runner.max_model_len,
            decode_only=True,
            no_history=False,
            seq_order=self.seq_order[:bs] if self.ordered else None,
        ).add_groups((s[:bs], t[:bs]) for s, t in zip(self.group_slots, self.group_tables, strict=True))

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.runner.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))
        return self.runner.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        for bs in reversed(self.sizes):  # largest first: the pool fits all the others
            self._forward(bs)  # warm-up (Triton compiles, allocator settles)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.logits[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize()

    def can_run(self, inp: DecodeRows) -> bool:
        return inp.num_seqs <= self.sizes[-1] and all(
            t.shape[1] <= self.max_blocks for t in [inp.block_tables, *(t for _, t in inp.group_tables)]
        )

    def run(self, inp: DecodeRows, fix=None) -> torch.Tensor:
        bs = inp.num_seqs
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        self.turn ^= 1
        h = self.host[self.turn]
        self.copied[self.turn].synchronize()  # normally long done: it is two steps old
        h["input_ids"][:bs].numpy()[:] = inp.input_ids
        h["input_ids"][bs:padded].fill_(0)  # stale rows may hold an old step's PLACEHOLDER
        h["positions"][bs:padded].fill_(0)  # padding rows: position 0 (stale ones are in range, but say so)
        h["positions"][:bs].numpy()[:] = inp.positions
        h["slot_mapping"][:padded].fill_(PAD_SLOT_ID)
        h["slot_mapping"][:bs].numpy()[:] = inp.slot_mapping
        h["seq_lens"][:padded].fill_(1)
        h["seq_lens"][:bs].numpy()[:] = inp.seq_lens
        h["seq_order"][:padded].numpy()[:] = longest_first(h["seq_lens"][:padded].numpy())  # padding rows last
        nb = inp.block_tables.shape[1]
        bt = h["block_tables"].numpy()
        bt[:bs, :nb] = inp.block_tables
        for g, (slots, tables) in enumerate(inp.group_tables, 1):
            h[f"slot_mapping{g}"][:padded].fill_(PAD_SLOT_ID)
            h[f"slot_mapping{g}"][:bs].numpy()[:] = slots
            h[f"block_tables{g}"].numpy()[:bs, : tables.shape[1]] = tables
        self.input_ids[:padded].copy_(h["input_ids"][:padded], non_blocking=True)
        self.positions[:padded].copy_(h["positions"][:padded], non_blocking=True)
        self.slot_mapping[:padded].copy_(h["slot_mapping"][:padded], non_blocking=True)
        self.seq_lens[:padded].copy_(h["seq_lens"][:padded], non_blocking=True)
        self.seq_order[:padded].copy_(h["seq_order"][:padded], non_blocking=True)
        self.block_tables[:bs].copy_(h["block_tables"][:bs], non_blocking=True)
        for g in range(1, self.num_groups):
            self.group_slots[g - 1][:padded].copy_(h[f"slot_mapping{g}"][:padded], non_blocking=True)
            self.group_tables[g - 1][:bs].copy_(h[f"block_tables{g}"][:bs], non_blocking=True)
        self.copied[self.turn].record()
        self.runner.fill_placeholders(self.input_ids, fix)  # async scheduling: ids from the device
        self.graphs[padded].replay()
        return self.logits[padded][:bs]
