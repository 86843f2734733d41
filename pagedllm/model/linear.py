"""Rank-aware linear layers (Megatron style).

ColumnParallelLinear splits the output features across ranks (no communication);
RowParallelLinear splits the input features and all-reduces the partial sums. Packed
projections (qkv, gate_up) are column-parallel layers whose checkpoint shards are loaded
into their slice of the packed weight by `load_weight(name, tensor, shard_id)`; a checkpoint
that stores the packed matrix (Phi-3) is cut into the same shards first.

`quantize_fp8()` (quantization="fp8", after loading) turns a layer's weight into e4m3 with one
scale per output channel; its forward then quantizes each token's activations (ops/fp8_linear.py).
An FP8 checkpoint (model/quant_config.py) is loaded into e4m3 weights made by `prepare_fp8()`, its
scales through `load_scale()` (per output row, or per tensor spread over the shard's rows; block-wise:
[rows / bn, columns / bk], this rank's blocks of its shard's rows or columns).
A 4-bit checkpoint (AWQ, GPTQ) replaces the weight with a packed one (`prepare_int4`, model/int4_layer.py)
that each checkpoint tensor's parts load into (`load_int4`); its forward runs ops/int4_linear.py.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.int4_layer import Int4Weight
from pagedllm.model.int4_weights import unpack_checkpoint
from pagedllm.model.parallel import ShardedModule, all_reduce, divide, tp_rank, tp_size
from pagedllm.ops.decode_gemm import linear as decode_linear
from pagedllm.ops.decode_gemm import tile_counters
from pagedllm.ops.fp8_block_linear import fp8_block_linear
from pagedllm.ops.fp8_linear import FP8, fp8_linear, fp8_linear_static, quantize_weight


class QuantizableLinear(ShardedModule):
    """A linear layer whose weight may be fp8 (`weight_scale` set): quantized once loaded
    (`quantize_fp8`), or loaded so from an FP8 checkpoint (`prepare_fp8` before loading, then
    `load_scale` for its scales; model/quant_config.py); or 4-bit (`int4` set, `weight` gone:
    `prepare_int4`, then `load_int4`)."""

    weight: nn.Parameter
    weight_scale: nn.Parameter | None  # float32 [this rank's output rows]; block-wise [rows / bn, columns / bk]
    input_scale: nn.Parameter | None  # static activations: the checkpoint's per-tensor scale
    weight_block: tuple[int, int] | None  # block-wise FP8: [bn, bk], one weight scale per block
    int4: Int4Weight | None  # a 4-bit checkpoint's packed weight (then there is no `weight`)
    tile_counters: torch.Tensor  # int32, the decode GEMM's split-K arrivals (ops/decode_gemm.py), zero between calls

    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("weight_scale", None)  # parameters, so an FP8 checkpoint's scales load by name
        self.register_parameter("input_scale", None)
        self.weight_block = None
        self.register_module("int4", None)

    def _add_tile_counters(self) -> None:
        """The decode GEMM's arrival counts for this rank's output rows: a buffer on the weight's device,
        not in the checkpoint."""
        self.register_buffer("tile_counters", tile_counters(self.weight.shape[0], self.weight.device), persistent=False)

    def features(self) -> tuple[int, int]:
        """(output rows, input columns) of this rank's weight."""
        if self.int4 is not None:
            return self.int4.shape
        return self.weight.shape[0], self.weight.shape[1]

    def prepare_int4(self, group: int, scale_dtype: torch.dtype) -> None:
        """A packed 4-bit weight with one scale per `group` of this rank's input rows, in place of `weight`."""
        n, k = self.features()
        device = self.weight.device
        del self.weight
        self.int4 = Int4Weight(n, k, group, scale_dtype, device)

    def load_int4(
        self, name: str, parts: dict[str, torch.Tensor], shard_id: int | str | None, method: str, zero_offset: int
    ) -> None:
        """A checkpoint layer's AWQ / GPTQ tensors (`qweight`, `qzeros`, `scales`, `g_idx`) into its place."""
        assert self.int4 is not None
        device = self.int4.qweight.device
        unpacked = unpack_checkpoint(method, {p: t.to(device) for p, t in parts.items()}, zero_offset)
        self.int4.load(name, unpacked, self.scale_rows(shard_id), self.scale_cols())

    def quantize_fp8(self) -> None:
        wq, scale = quantize_weight(self.weight.data)
        self.weight = nn.Parameter(wq, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)  # on the weight's device; never moved afterwards

    def prepare_fp8(self, static_activations: bool, block: tuple[int, int] | None = None) -> None:
        """An e4m3 weight and float32 scales (per output row, or per block: this rank's rows and
        columns must be multiples of it, model/quantization.py) for an FP8 checkpoint to load into."""
        w = self.weight
        self.weight = nn.Parameter(torch.empty(w.shape, dtype=FP8, device=w.device), requires_grad=False)
        shape = (w.shape[0],) if block is None else (w.shape[0] // block[0], w.shape[1] // block[1])
        self.weight_scale = nn.Parameter(torch.zeros(shape, device=w.device), requires_grad=False)
        self.weight_block = block
        if static_activations:  # the max over the checkpoint's shards (q/k/v see the same input)
            self.input_scale = nn.Parameter(torch.zeros((), device=w.device), requires_grad=False)

    def scale_rows(self, shard_id: int | str | None) -> list[tuple[int, int, int, int]]:
        """Where a checkpoint tensor's per-output-row scales go: (offset here, rows here, rows in the
        checkpoint tensor, this rank's first row in it) per part (a packed matrix has several)."""
        raise NotImplementedError

    def scale_cols(self) -> tuple[int, int, int]:
        """This rank's input columns: (how many, the first, columns in the checkpoint tensor)."""
        k = self.features()[1]
        return k, 0, k

    def checkpoint_parts(self) -> tuple[list[int], int, bool]:
        """(output rows of each checkpoint tensor packed here, input columns, split by rows: column-parallel)."""
        raise NotImplementedError

    def load_scale(self, name: str, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        """`weight_scale` (one per output row, or one per tensor: then every row of the shard takes
        it; block-wise, also named `weight_scale_inv`: one per block) or `input_scale` (static
        activations; the largest of the shards')."""
        if self.weight_block is not None:
            self._load_block_scale(name, loaded, shard_id)
            return
        if name == "weight_scale_inv":
            raise ValueError(f"{name} holds block-wise scales, and the checkpoint's config has no weight_block_size")
        values = loaded.float().reshape(-1)
        if name == "input_scale":
            assert self.input_scale is not None and values.numel() == 1, (name, loaded.shape)
            self.input_scale.data.copy_(torch.maximum(self.input_scale.data, values[0].to(self.input_scale.device)))
            return
        assert name == "weight_scale" and self.weight_scale is not None, name
        parts = self.scale_rows(shard_id)
        total = sum(p[2] for p in parts)
        if values.numel() not in (1, total):
            raise ValueError(f"{name} has {values.numel()} values for {total} output rows (per tensor: 1)")
        start = 0
        for offset, size, rows, first in parts:
            dst = self.weight_scale.data.narrow(0, offset, size)
            dst.copy_(values.expand(size) if values.numel() == 1 else values.narrow(0, start + first, size))
            start += rows

    def _load_block_scale(self, name: str, loaded: torch.Tensor, shard_id: int | str | None) -> None:
        """[rows / bn, columns / bk] of the checkpoint tensor: this rank's blocks of each part."""
        assert self.weight_block is not None and self.weight_scale is not None
        assert name in ("weight_scale", "weight_scale_inv"), name
        bn, bk = self.weight_block
        parts = self.scale_rows(shard_id)
        k_here, k_first, k_total = self.scale_cols()
        want = (sum(p[2] for p in parts) // bn, k_total // bk)
        if tuple(loaded.shape) != want:
            raise ValueError(f"{name} has shape {tuple(loaded.shape)}, expected {want} (blocks of {bn}x{bk})")
        cols = loaded.float().narrow(1, k_first // bk, k_here // bk)
        start = 0
        for offset, size, rows, first in parts:
            dst = self.weight_scale.data.narrow(0, offset // bn, size // bn)
            dst.copy_(cols.narrow(0, (start + first) // bn, size // bn))
            start += rows

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.int4 is not None:
            return self.int4(x, bias)
        if self.weight_scale is None:  # few bf16 rows on CUDA: ops/decode_gemm.py
            return decode_linear(x, self.weight, bias, self.tile_counters)
        if self.weight_block is not None:
            return fp8_block_linear(x, self.weight, self.weight_scale, self.weight_block, bias)
        if self.input_scale is not None:
            return fp8_linear_static(x, self.weight, self.weight_scale, self.input_scale, bias)
        return fp8_linear(x, self.weight, self.weight_scale, bias)


class ColumnParallelLinear(QuantizableLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp_size, self.tp_rank = tp_size(), tp_rank()
        self.out_per_rank = divide(out_features, self.tp_size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) if bias else None
        self._add_tile_counters()

    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        param = self.get_parameter(name)
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * n, n))

    def scale_rows(self, shard_id: int | str | None) -> list[tuple[int, int, int, int]]:
        n = self.out_per_rank
        return [(0, n, n * self.tp_size, self.tp_rank * n)]

    def checkpoint_parts(self) -> tuple[list[int], int, bool]:
        return [self.out_per_rank * self.tp_size], self.features()[1], True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed in one matrix, e.g. gate_up = [gate; up]."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def shard_range(self, shard_id: int) -> tuple[int, int]:
        sizes = [s // self.tp_size for s in self.output_sizes]
        return sum(sizes[:shard_id]), sizes[shard_id]

    def shard_index(self, shard_id: int | str | None) -> int:
        assert isinstance(shard_id, int), shard_id
        return shard_id

    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        """One shard of the packed matrix; shard_id None: the checkpoint stores the packed matrix
        itself (Phi-3's qkv_proj, gate_up_proj), cut into its shards, each sliced for this rank."""
        if shard_id is None:
            for index, part in enumerate(loaded.split(self.output_sizes)):
                self._load_shard(name, part, index)
        else:
            self._load_shard(name, loaded, self.shard_index(shard_id))

    def scale_rows(self, shard_id: int | str | None) -> list[tuple[int, int, int, int]]:
        """One part per shard the checkpoint tensor holds: all of them for a packed matrix (None)."""
        indexes = range(len(self.output_sizes)) if shard_id is None else [self.shard_index(shard_id)]
        parts = []
        for index in indexes:
            offset, size = self.shard_range(index)
            parts.append((offset, size, self.output_sizes[index], self.tp_rank * size))
        return parts

    def checkpoint_parts(self) -> tuple[list[int], int, bool]:
        return list(self.output_sizes), self.features()[1], True

    def _load_shard(self, name: str, loaded: torch.Tensor, index: int) -> None:
        if loaded.shape[0] != self.output_sizes[index]:
            raise ValueError(f"shard {index} of {name} has {loaded.shape[0]} rows, expected {self.output_sizes[index]}")
        offset, size = self.shard_range(index)
        self.get_parameter(name).data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v packed; split by heads. shard_id is "q", "k" or "v"."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = tp_size()
        divide(num_heads, tp, "num_attention_heads")
        divide(num_kv_heads, tp, "num_key_value_heads")
        super().__init__(hidden, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias)

    def shard_index(self, shard_id: int | str | None) -> int:
        return {"q": 0, "k": 1, "v": 2}[str(shard_id)]


class RowParallelLinear(QuantizableLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp_size, self.tp_rank = tp_size(), tp_rank()
        self.in_per_rank = divide(in_features, self.tp_size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._add_tile_counters()

    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        param = self.get_parameter(name)
        if name == "bias":  # added once, after the all-reduce: every rank holds all of it
            param.data.copy_(loaded)
            return
        n = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))

    def scale_rows(self, shard_id: int | str | None) -> list[tuple[int, int, int, int]]:
        n = self.features()[0]  # every rank holds every output row
        return [(0, n, n, 0)]

    def scale_cols(self) -> tuple[int, int, int]:
        k = self.in_per_rank
        return k, self.tp_rank * k, k * self.tp_size

    def checkpoint_parts(self) -> tuple[list[int], int, bool]:
        return [self.features()[0]], self.in_per_rank * self.tp_size, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, None)
        all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
