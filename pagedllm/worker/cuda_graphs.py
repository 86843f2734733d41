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
from pagedllm.worker.staging import PackedInputs

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
        self.ordered = envs.decode_launch_order() == "longest"
        self.num_groups = len(runner.kv_cache_groups)
        self.inputs = PackedInputs(
            [
                ("input_ids", torch.int64, (max_bs,)),
                ("positions", torch.int64, (max_bs,)),
                ("slot_mapping", torch.int64, (max_bs,)),
                *((f"slot_mapping{g}", torch.int64, (max_bs,)) for g in range(1, self.num_groups)),
                ("seq_lens", torch.int32, (max_bs,)),
                ("seq_order", torch.int32, (max_bs,)),  # decode attention's launch order
                ("block_tables", torch.int32, (max_bs, self.max_blocks)),
                *((f"block_tables{g}", torch.int32, (max_bs, self.max_blocks)) for g in range(1, self.num_groups)),
            ],
            dev,
        )
        d = self.inputs.dev
        self.input_ids, self.positions, self.slot_mapping = d["input_ids"], d["positions"], d["slot_mapping"]
        self.block_tables, self.seq_lens, self.seq_order = d["block_tables"], d["seq_lens"], d["seq_order"]
        self.group_slots = [d[f"slot_mapping{g}"] for g in range(1, self.num_groups)]
        self.group_tables = [d[f"block_tables{g}"] for g in range(1, self.num_groups)]
        for t in (self.slot_mapping, *self.group_slots):
            t.fill_(PAD_SLOT_ID)
        self.seq_lens.fill_(1)
        self.seq_order.copy_(torch.arange(max_bs, dtype=torch.int32))
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
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
        h = self.inputs.next_host()
        h["input_ids"][:bs] = inp.input_ids
        h["input_ids"][bs:padded] = 0  # stale rows may hold an old step's PLACEHOLDER
        h["positions"][:bs] = inp.positions
        h["positions"][bs:padded] = 0  # padding rows: position 0 (stale ones are in range, but say so)
        h["slot_mapping"][:bs] = inp.slot_mapping
        h["slot_mapping"][bs:padded] = PAD_SLOT_ID
        h["seq_lens"][:bs] = inp.seq_lens
        h["seq_lens"][bs:padded] = 1
        h["seq_order"][:padded] = longest_first(h["seq_lens"][:padded])  # padding rows last
        h["block_tables"][:bs, : inp.block_tables.shape[1]] = inp.block_tables
        for g, (slots, tables) in enumerate(inp.group_tables, 1):
            h[f"slot_mapping{g}"][:bs] = slots
            h[f"slot_mapping{g}"][bs:padded] = PAD_SLOT_ID
            h[f"block_tables{g}"][:bs, : tables.shape[1]] = tables
        self.inputs.upload(bs)
        self.runner.fill_placeholders(self.input_ids, fix)  # async scheduling: ids from the device
        self.graphs[padded].replay()
        return self.logits[padded][:bs]
