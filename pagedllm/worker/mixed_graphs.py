"""Whole-step CUDA graphs for small prefill and mixed steps (a prompt admitted beside a few decodes).

At low load a new request's first step is its prompt chunk beside a handful of decodes: a few
hundred tokens, a few sequences. Its device time is a millisecond or two, and launching it
eagerly, or even in pieces around each layer's attention (piecewise_graphs.py: two Triton
launches a layer from Python), costs several more on the host, all of it on the request's time
to first token. So steps of at most 2,048 tokens in at most 64 sequences replay one graph of the
whole forward, attention included, captured per (token bucket T, sequence bucket B).

Attention's grid is sized from its arguments, not from the data: captured with max_seqlen_q = T
and B sequences, a program whose query tile is past its sequence's new tokens returns at once.
A step of n <= T tokens in b <= B sequences fills the static buffers: padding sequences get no
new tokens (cu_seqlens_q repeats n, seq_lens 0), padding tokens belong to no sequence (token 0 at
position 0, slot PAD_SLOT_ID: stored nowhere, attended by nobody). Their rows of the attention
output are never written and may hold anything, so models with routed experts (whose router
would take a NaN row to no expert) use the piecewise graphs instead, which keep those rows finite.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.ops import PAD_SLOT_ID
from pagedllm.ops.attention_metadata import AttentionMetadata
from pagedllm.worker.staging import PackedInputs
from pagedllm.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from pagedllm.worker.runner_view import GraphRunner

# Token buckets about a quarter apart above 256, not powers of two: the 16 req/s serving step is a
# 512-token prompt beside ~3 decodes, 515 tokens, which a 1,024 bucket ran at twice its GEMM work.
TOKEN_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1536, 2048)
SEQ_BUCKETS = (4, 16, 64)


def bucket_pair(n: int, nseq: int, token_sizes: list[int], seq_sizes: list[int]) -> tuple[int, int] | None:
    """The smallest (tokens, sequences) bucket a step of n tokens in nseq sequences fits, if any
    (a captured pair has sequences <= tokens)."""
    if n > token_sizes[-1] or nseq > seq_sizes[-1]:
        return None
    b = seq_sizes[bisect.bisect_left(seq_sizes, nseq)]
    i = bisect.bisect_left(token_sizes, max(n, b))
    return (token_sizes[i], b) if i < len(token_sizes) else None


class MixedGraphs:
    def __init__(self, runner: GraphRunner):
        self.runner = runner
        dev = runner.device
        self.token_sizes = [t for t in TOKEN_BUCKETS if t <= runner.max_num_batched_tokens]
        self.seq_sizes = [b for b in SEQ_BUCKETS if b <= runner.max_num_seqs] or [runner.max_num_seqs]
        top_t, top_b = self.token_sizes[-1], self.seq_sizes[-1]
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        groups = len(runner.kv_cache_groups)
        self.groups = groups
        self.inputs = PackedInputs(
            [
                ("input_ids", torch.int64, (top_t,)),
                ("positions", torch.int64, (top_t,)),
                *((f"slot_mapping{g}", torch.int64, (top_t,)) for g in range(groups)),
                ("cu_seqlens_q", torch.int32, (top_b + 1,)),
                ("seq_lens", torch.int32, (top_b,)),
                *((f"block_tables{g}", torch.int32, (top_b, self.max_blocks)) for g in range(groups)),
            ],
            dev,
        )
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}
        self.pool: _POOL_HANDLE | None = None
        self._capture_all()

    def _meta(self, t: int, b: int) -> AttentionMetadata:
        d = self.inputs.dev
        return AttentionMetadata(
            slot_mapping=d["slot_mapping0"][:t],
            block_tables=d["block_tables0"][:b],
            cu_seqlens_q=d["cu_seqlens_q"][: b + 1],
            seq_lens=d["seq_lens"][:b],
            max_seqlen_q=t,  # sizes the grid: every step of <= t tokens fits
            max_seqlen_k=self.runner.max_model_len,
            decode_only=False,
            no_history=False,
        ).add_groups((d[f"slot_mapping{g}"][:t], d[f"block_tables{g}"][:b]) for g in range(1, self.groups))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        model = self.runner.model
        for t in reversed(self.token_sizes):  # largest first: the pool then fits the others
            for b in reversed(self.seq_sizes):
                if b > t:
                    continue
                # capture over a valid step (its warm-up forward runs it for real): b sequences of at
                # most max_model_len tokens each, no history, stored nowhere, attending block 0
                cu = capture_split(t, b, self.runner.max_model_len)
                n = int(cu[-1])
                tables = [(np.full(n, PAD_SLOT_ID), np.zeros((b, self.max_blocks), np.int32))] * self.groups
                ids = np.arange(n, dtype=np.int64) % 7
                write_padded_step(
                    self.inputs.next_host(), ids, np.zeros(n, np.int64), cu, np.diff(cu).astype(np.int32), tables, t, b
                )
                self.inputs.upload(b)
                args = (self.inputs.dev["input_ids"][:t], self.inputs.dev["positions"][:t], self._meta(t, b))
                model(*args)  # warm-up: Triton compiles, the allocator settles
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    self.hidden[(t, b)] = model(*args)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[(t, b)] = g
        torch.cuda.synchronize()

    def pair(self, n: int, nseq: int) -> tuple[int, int] | None:
        """The captured (tokens, sequences) a step of n tokens in nseq sequences replays, if any."""
        return bucket_pair(n, nseq, self.token_sizes, self.seq_sizes)

    def can_run(self, inp: StepInputs) -> bool:
        return self.pair(inp.num_tokens, inp.num_seqs) in self.graphs and all(
            tb.shape[1] <= self.max_blocks for tb in [inp.block_tables, *(t for _, t in inp.group_tables)]
        )

    def run(self, inp: StepInputs, fix=None) -> torch.Tensor:
        """The step's hidden states [n, hidden]."""
        pair = self.pair(inp.num_tokens, inp.num_seqs)
        assert pair is not None and pair in self.graphs, "can_run first"
        t, b = pair
        tables = [(inp.slot_mapping, inp.block_tables), *inp.group_tables]
        h = self.inputs.next_host()
        write_padded_step(h, inp.input_ids, inp.positions, inp.cu_seqlens_q, inp.seq_lens, tables, t, b)
        self.inputs.upload(b)  # the 1-D buffers whole (~50 KB) and the tables' first b rows
        self.runner.fill_placeholders(self.inputs.dev["input_ids"], fix)  # async scheduling: ids from the device
        self.graphs[(t, b)].replay()
        return self.hidden[pair][: inp.num_tokens]


def padded_step(
    ids: np.ndarray,
    positions: np.ndarray,
    cu: np.ndarray,
    seq_lens: np.ndarray,
    tables: list[tuple[np.ndarray, np.ndarray]],
    t: int,
    b: int,
) -> dict[str, np.ndarray]:
    """The arrays of a (t, b) graph's step (`write_padded_step`) on their own, sized t and b."""
    width = max(bt.shape[1] for _, bt in tables)
    arrays: dict[str, np.ndarray] = {
        "input_ids": np.zeros(t, np.int64),
        "positions": np.zeros(t, np.int64),
        "cu_seqlens_q": np.zeros(b + 1, np.int32),
        "seq_lens": np.zeros(b, np.int32),
    }
    for g in range(len(tables)):
        arrays[f"slot_mapping{g}"] = np.zeros(t, np.int64)
        arrays[f"block_tables{g}"] = np.zeros((b, width), np.int32)
    write_padded_step(arrays, ids, positions, cu, seq_lens, tables, t, b)
    return arrays


def write_padded_step(
    dst: dict[str, np.ndarray],
    ids: np.ndarray,
    positions: np.ndarray,
    cu: np.ndarray,
    seq_lens: np.ndarray,
    tables: list[tuple[np.ndarray, np.ndarray]],
    t: int,
    b: int,
) -> None:
    """Write a step of n tokens in nseq sequences into `dst` as the (t, b) graph reads it: padding
    tokens are token 0 at position 0 stored nowhere (PAD_SLOT_ID) and in no sequence; padding
    sequences have no new tokens (cu_seqlens_q repeats n) and length 0, so their programs return
    before reading a block-table row. tables: (slot_mapping, block_tables) per KV-cache group; a
    table's rows past nseq and columns past the step's width keep what they held (never read)."""
    n, nseq = len(ids), len(seq_lens)
    assert n <= t and nseq <= b, (n, t, nseq, b)
    for name, a, fill in (("input_ids", ids, 0), ("positions", positions, 0)):
        dst[name][:n] = a
        dst[name][n:t] = fill
    dst["cu_seqlens_q"][: nseq + 1] = cu
    dst["cu_seqlens_q"][nseq + 1 : b + 1] = n
    dst["seq_lens"][:nseq] = seq_lens
    dst["seq_lens"][nseq:b] = 0
    for g, (slots, bt) in enumerate(tables):
        dst[f"slot_mapping{g}"][:n] = slots
        dst[f"slot_mapping{g}"][n:t] = PAD_SLOT_ID
        dst[f"block_tables{g}"][:nseq, : bt.shape[1]] = bt


def capture_split(t: int, b: int, max_len: int) -> np.ndarray:
    """cu_seqlens_q of b sequences sharing up to t tokens (t >= b), none longer than max_len: the
    tokens past b * max_len are padding. A sequence longer than max_len would read its block-table
    row past the buffer's width of cdiv(max_model_len, block_size) entries (issue 29: with
    max_num_seqs 5 and max_model_len 256 the 2,048-token capture split into 4 x 512 read 32 entries
    past the buffer's end, garbage block ids, and the KV gather faulted outside a small pool)."""
    lens = np.full(b, t // b, dtype=np.int64)
    lens[: t - lens.sum()] += 1
    lens = np.minimum(lens, max_len)
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
