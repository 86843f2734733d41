"""Piecewise CUDA graphs for the steps decode graphs cannot take: prefills and mixed steps.

A step that admits a prompt runs its chunk beside the decodes, so its shape changes every time:
captured whole it would need a graph per (tokens, sequences, longest chunk). But only attention
depends on how the tokens split into sequences; everything else (embedding, norms, projections,
the MLP, rotary) depends on the number of tokens alone. So the forward is cut at each layer's
attention (DecoderLayer.before_attention / self_attn.attend / after_attention) and the pieces
between two attentions are captured once per token bucket T (16, 32, ..., up to
max_num_batched_tokens): L + 1 graphs per bucket. A step of n <= T tokens copies its ids and
positions into the static buffers (padding rows: token 0 at position 0, whose K/V go nowhere:
their slots are PAD_SLOT_ID), replays piece 0, and for each layer runs attention eagerly on the
piece's q, k, v (real rows only are read: the metadata's cu_seqlens_q ends at n), copies its
output into the one buffer the next piece reads, and replays that piece. Eager, the same step
launches ~14 kernels a layer from Python (most of a prefill step's host time at low load);
here it launches two or three (attention, the copy) and L + 1 replays.

Memory: the pieces of all buckets share one graph pool; a piece's outputs are kept only until
the next piece of its bucket is captured (replays run in capture order, so later pieces may
reuse what earlier ones no longer need), and the last piece's output (the hidden states) per bucket.
Each piece copies its q, k, v into one static buffer of the largest bucket's rows, which every
layer and every bucket reuses (attention reads them before the next piece replays): kept per
layer and per bucket, they cost L x (q + k + v) x the sum of the buckets, 28 GiB for a
Qwen3-32B shape with 8,192-token steps (taken from the headroom the KV sizing leaves, which ran
out at start-up on the H200), against 0.16 GiB shared.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.ops.attention_metadata import AttentionMetadata
from pagedllm.worker.staging import PackedInputs
from pagedllm.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from pagedllm.model.decoder import DecoderLayer, DecoderModel
    from pagedllm.worker.runner_view import GraphRunner

MIN_BUCKET = 16


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, ... doubling to 2048, then every 2048, and max_tokens itself."""
    sizes, b = [], MIN_BUCKET
    while b < min(max_tokens, 2048):
        sizes.append(b)
        b *= 2
    sizes += list(range(2048, max_tokens, 2048))
    return sorted(set(sizes + [max_tokens]))


@dataclass
class _Bucket:
    graphs: list[torch.cuda.CUDAGraph]  # L + 1 pieces
    qkv: list[
        tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ]  # piece i's q, k, v (layer i's attention input): views of the shared buffer
    hidden: torch.Tensor  # the last piece's output [T, hidden]


class PiecewiseGraphs:
    def __init__(self, runner: GraphRunner, max_tokens: int):
        self.runner = runner
        dev = runner.device
        self.model: DecoderModel = runner.model.model  # embed, layers, final_norm
        self.layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
        self.sizes = token_buckets(max_tokens)
        top = self.sizes[-1]
        self.inputs = PackedInputs([(n, torch.int64, (top,)) for n in ("input_ids", "positions")], dev)
        self.input_ids, self.positions = self.inputs.dev["input_ids"], self.inputs.dev["positions"]
        attn = self.layers[0].self_attn
        self.attn_out = torch.zeros(top, attn.num_heads * attn.head_dim, dtype=runner.dtype, device=dev)
        self.buckets: dict[int, _Bucket] = {}
        # q, k, v of every piece, every bucket: one buffer per (widths, dtype) (_static_qkv)
        self.qkv_buffers: dict[tuple, torch.Tensor] = {}
        self.pool: _POOL_HANDLE | None = None
        self._capture_all()

    def can_run(self, inp: StepInputs) -> bool:
        return inp.num_tokens <= self.sizes[-1]

    def bucket(self, n: int) -> int:
        """The captured token count a step of n tokens runs at."""
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    # ---- capture ---------------------------------------------------------------------------
    def _piece(self, i: int, t: int, carried):
        """Piece i of a bucket of t tokens: layer i-1's after_attention (i > 0) then layer i's
        before_attention (i < L) or the final norm (i = L). carried: the residual stream from piece i-1."""
        layers = self.layers
        if i == 0:
            x, residual = self.model.embed(self.input_ids[:t]), None
        else:
            x, residual = layers[i - 1].after_attention(self.attn_out[:t], carried)
        if i == len(layers):
            return self.model.final_norm(x, residual)
        q, k, v, residual = layers[i].before_attention(x, residual)
        return (*self._static_qkv(t, q, k, v), residual)

    def _static_qkv(
        self, t: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v copied into the first t rows of the shared buffer (made at the first call, which
        is the largest bucket's warm-up), in the layout of one packed qkv projection."""
        widths = [q[0].numel(), k[0].numel(), v[0].numel()]
        key = (tuple(widths), q.dtype)
        buf = self.qkv_buffers.get(key)
        if buf is None:
            buf = torch.empty(self.sizes[-1], sum(widths), dtype=q.dtype, device=q.device)
            self.qkv_buffers[key] = buf
        parts = buf[:t].split(widths, dim=-1)
        sq, sk, sv = (p.view(t, *x.shape[1:]) for p, x in zip(parts, (q, k, v), strict=True))
        sq.copy_(q)
        sk.copy_(k)
        sv.copy_(v)
        return sq, sk, sv

    @torch.inference_mode()
    def _capture_all(self) -> None:
        n = len(self.layers)
        for t in reversed(self.sizes):  # largest first: the pool then fits the others
            graphs, qkv = [], []
            carried = None
            for i in range(n + 1):
                self._piece(i, t, carried)  # warm-up: Triton compiles, the allocator settles
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    out = self._piece(i, t, carried)
                if self.pool is None:
                    self.pool = g.pool()
                graphs.append(g)
                if i < n:
                    q, k, v, carried = out
                    qkv.append((q, k, v))
                else:
                    hidden = out
            self.buckets[t] = _Bucket(graphs, qkv, hidden)
        torch.cuda.synchronize()

    # ---- a step ----------------------------------------------------------------------------
    def run(self, inp: StepInputs, meta: AttentionMetadata, fix=None) -> torch.Tensor:
        """The step's hidden states [n, hidden]. meta: the step's metadata with its slot
        mappings padded to the bucket with PAD_SLOT_ID (staging.pad_to)."""
        n = inp.num_tokens
        t = self.bucket(n)
        b = self.buckets[t]
        h = self.inputs.next_host()
        h["input_ids"][:n] = inp.input_ids
        h["positions"][:n] = inp.positions
        h["input_ids"][n:t] = 0  # padding rows: token 0 at position 0
        h["positions"][n:t] = 0
        self.inputs.upload(0, entries=t)
        self.runner.fill_placeholders(self.input_ids, fix)  # async scheduling: ids from the device
        positions = self.positions[:t]
        layers = self.layers
        b.graphs[0].replay()
        for i, layer in enumerate(layers):
            q, k, v = b.qkv[i]
            o = layer.self_attn.attend(positions, q, k, v, meta)
            # the real rows only: padding rows keep finite values (attention leaves its rows unset,
            # and NaN there could send a MoE router's padding tokens to no expert at all)
            self.attn_out[:n].copy_(o.view(t, -1)[:n])
            b.graphs[i + 1].replay()
        return b.hidden[:n]
