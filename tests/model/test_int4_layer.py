"""model/int4_layer.py: a 4-bit checkpoint layer packed into a linear layer's place (the parts of a
packed qkv concatenated along N, desc_act rows sorted by group), its memory against the model dtype's,
and what model/quantization.py refuses or leaves dequantized."""

from __future__ import annotations

import pytest
import torch

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.model.int4_weights import dequantize_awq, dequantize_gptq
from pagedllm.model.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model.quant_config import CheckpointQuant
from pagedllm.model.quantization import int4_layout
from tests.helpers import load_script

int4_tensors = load_script("tools/quantize_checkpoint.py").int4_tensors  # the test checkpoints' quantizer


def nbytes(module: torch.nn.Module) -> int:
    """The weight's bytes: parameters and buffers, less the decode GEMM's split-K counters (1 KB here)."""
    tensors = [*module.parameters(), *(b for name, b in module.named_buffers() if name != "tile_counters")]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_the_packed_layer_takes_about_a_quarter_of_the_bf16_bytes():
    """4 bits a weight, plus per 128 input rows a float16 scale and a uint8 zero: 2 / (0.5 + 3 / 128) = 3.8x."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = ColumnParallelLinear(4096, 4096)
    finally:
        torch.set_default_dtype(default)
    bf16 = nbytes(layer)
    assert bf16 == 4096 * 4096 * 2
    layer.prepare_int4(128, torch.float16)
    assert not hasattr(layer, "weight") and layer.features() == (4096, 4096)
    assert 3.7 < bf16 / nbytes(layer) < 4.0


def test_qkv_parts_concatenate_along_n_and_desc_act_rows_unsort():
    """q, k, v of a GPTQ desc_act checkpoint (one input order, as GPTQ's shared inputs give) load into
    their columns; the packed weight means the dequantized parts, concatenated."""
    torch.manual_seed(0)
    layer = QKVParallelLinear(hidden=64, head_dim=16, num_heads=4, num_kv_heads=2)
    layer.prepare_int4(32, torch.float32)
    want = []
    for shard, rows in (("q", 64), ("k", 32), ("v", 32)):
        parts = int4_tensors(torch.randn(rows, 64), "gptq", 32, sym=False, desc_act=True)
        layer.load_int4(f"layers.0.{shard}_proj", parts, shard, "gptq", zero_offset=1)
        want.append(dequantize_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"], 1))
    assert layer.int4 is not None and layer.int4.perm is not None
    torch.testing.assert_close(layer.int4.weight(), torch.cat(want), rtol=0, atol=0)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ torch.cat(want).t(), rtol=1e-5, atol=1e-5)


def test_parts_with_different_input_orders_are_refused():
    layer = QKVParallelLinear(hidden=64, head_dim=16, num_heads=4, num_kv_heads=2)
    layer.prepare_int4(32, torch.float32)
    q = int4_tensors(torch.randn(64, 64), "gptq", 32, sym=True, desc_act=True)
    k = int4_tensors(torch.randn(32, 64), "gptq", 32, sym=True, desc_act=False)
    layer.load_int4("q_proj", q, "q", "gptq", 1)
    with pytest.raises(ValueError, match="input orders"):
        layer.load_int4("k_proj", k, "k", "gptq", 1)


def test_awq_layer_loads_its_columns():
    torch.manual_seed(1)
    layer = ColumnParallelLinear(128, 48)
    layer.prepare_int4(64, torch.float32)
    parts = int4_tensors(torch.randn(48, 128), "awq", 64, sym=False, desc_act=False)
    layer.load_int4("o_proj", parts, None, "awq", 0)
    assert layer.int4 is not None and layer.int4.perm is None
    want = dequantize_awq(parts["qweight"], parts["qzeros"], parts["scales"])
    torch.testing.assert_close(layer.int4.weight(), want, rtol=0, atol=0)


def gptq(group: int, desc_act: bool = False) -> CheckpointQuant:
    return CheckpointQuant("gptq", int4=True, zero_offset=1, group_size=group, desc_act=desc_act)


def row_shard(layer: RowParallelLinear, tp: int) -> RowParallelLinear:
    """The layer as one rank of `tp` would hold it (its input columns split)."""
    layer.tp_size, layer.in_per_rank = tp, layer.in_per_rank // tp
    layer.weight = torch.nn.Parameter(torch.empty(layer.weight.shape[0], layer.in_per_rank), requires_grad=False)
    return layer


def test_int4_layout_keeps_whole_groups_per_rank():
    assert int4_layout("o", RowParallelLinear(256, 64), gptq(128)) == 128
    assert int4_layout("o", row_shard(RowParallelLinear(256, 64), 2), gptq(128)) == 128
    assert int4_layout("o", row_shard(RowParallelLinear(256, 64), 2), gptq(-1)) == 128  # a rank's half of the group
    assert int4_layout("o", row_shard(RowParallelLinear(256, 64), 2), gptq(64, desc_act=True)) is None  # dequantized
    assert int4_layout("o", ColumnParallelLinear(256, 64), gptq(8)) is None  # a K tile under a dot's 16 rows
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size=4 splits the 4-bit groups of layer o") as e:
        int4_layout("o", row_shard(RowParallelLinear(256, 64), 4), gptq(128))
    assert e.value.param == "tensor_parallel_size"
    assert int4_layout("o", ColumnParallelLinear(256, 64), gptq(96)) is None  # the loader refuses it (uneven groups)
