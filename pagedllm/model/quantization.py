"""`quantization` (vLLM's argument): weights quantized when the model is loaded.

"fp8" quantizes every linear layer of the decoder layers (q/k/v, o, gate/up, down) to e4m3 with
one scale per output channel, as vLLM's on-the-fly FP8 does; embeddings, norms and the LM head
stay in the model's dtype. Activations are quantized per token at run time (ops/fp8_linear.py).
A mixture of experts' experts are quantized too (model/moe_quant.py), the router stays in the model's
dtype (as vLLM). What it cannot do exactly is refused naming the argument: a GPU without fp8 tensor
cores (compute capability < 8.9).
A checkpoint that is already quantized (config.json's quantization_config, read by
model/quant_config.py) is loaded as it is: `prepare_checkpoint_fp8` makes its layers e4m3 before
the weights load into them (model/loader.py), its `ignore` list's layers staying unquantized.
Block-wise FP8 needs whole blocks: every part of a layer (q, k, v of a packed qkv), and each TP
shard, a multiple of the block in the dimension it splits, else refused naming the layer.
A 4-bit checkpoint (AWQ, GPTQ): `prepare_checkpoint_int4` gives each of its layers a packed weight
(model/int4_layer.py) for the kernel (ops/int4_linear.py), or leaves it in the model's dtype, to be
dequantized at load, where the kernel cannot take it (`int4_layout`).
A mixture of experts' quantized experts: model/quant_experts.py.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.engine.config import QUANTIZATION_METHODS
from pagedllm.engine.errors import InvalidRequestError
from pagedllm.model.linear import QuantizableLinear
from pagedllm.model.moe import SparseMoeBlock
from pagedllm.model.moe_quant import Fp8FusedExperts
from pagedllm.model.quant_config import CheckpointQuant, read_quant_config
from pagedllm.model.quant_experts import prepare_experts_fp8, prepare_experts_int4
from pagedllm.ops.fp8_block_linear import block_k_tile
from pagedllm.ops.int4_linear import MIN_BLOCK_K
from pagedllm.ops.int4_linear import block_k_tile as int4_k_tile


def check_fp8_runs(device: torch.device, what: str, param: str) -> None:
    """FP8 layers need fp8 tensor cores: refused (InvalidRequestError naming `param`) on a GPU of compute
    capability < 8.9."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise InvalidRequestError(
            f"{what} needs fp8 tensor cores (compute capability >= 8.9); this GPU has "
            f"{torch.cuda.get_device_capability(device)}",
            param,
        )


def quantize_linears(model: nn.Module, method: str, device: torch.device) -> int:
    """Quantize the model's decoder linear layers and experts in place (one scale per output row); returns
    how many layers. InvalidRequestError (param "quantization") for a method it cannot apply."""
    if method not in QUANTIZATION_METHODS:
        raise InvalidRequestError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}", "quantization")
    check_fp8_runs(device, "quantization='fp8'", "quantization")
    layers = [m for m in model.modules() if isinstance(m, QuantizableLinear)]
    for m in layers:
        m.quantize_fp8()
    moes = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    for moe in moes:
        moe.experts = Fp8FusedExperts(moe.experts, None, quantize=True)
    return len(layers) + len(moes)


def quantized_layers(model: nn.Module, quant: CheckpointQuant) -> list[tuple[str, QuantizableLinear]]:
    """The decoder linear layers the checkpoint quantized (not in its ignore list). A packed layer (qkv,
    gate_up) whose checkpoint parts are quantized and not is refused naming quantization_config.ignore."""
    packed = getattr(model, "packed_modules", {})
    layers = []
    for name, m in model.named_modules():
        if not isinstance(m, QuantizableLinear):
            continue
        owner, _, leaf = name.rpartition(".")
        parts = [f"{owner}.{ckpt}" for ckpt, (packed_part, _) in packed.items() if packed_part == leaf] or [name]
        ignored = {quant.ignores(p) for p in parts}
        if ignored == {True, False}:
            raise InvalidRequestError(
                f"quantization_config.ignore={list(quant.ignore)!r} leaves part of the packed layer {name} "
                f"unquantized ({', '.join(p for p in parts if quant.ignores(p))}): its parts must be quantized alike",
                "quantization_config.ignore",
            )
        if ignored == {False}:
            layers.append((name, m))
    return layers


def prepare_checkpoint_fp8(model: nn.Module, quant: CheckpointQuant, device: torch.device) -> int:
    """Before loading an FP8 checkpoint: every decoder linear layer it quantized gets an e4m3 weight
    and scales to load into; returns how many. A packed layer (qkv, gate_up) whose checkpoint parts
    are quantized and not is refused, as are a mixture of experts and a GPU without fp8 tensor cores."""
    check_fp8_runs(device, f"an FP8 checkpoint ({quant.method})", "quantization_config")
    layers = quantized_layers(model, quant)
    for name, m in layers:
        if quant.weight_block is not None:
            check_blocks(name, m, quant.weight_block, quant.block_field, device)
        m.prepare_fp8(quant.static_activations, quant.weight_block)
    return len(layers) + prepare_experts_fp8(model, quant, device)


def prepare_checkpoint_int4(model: nn.Module, quant: CheckpointQuant) -> int:
    """Before loading a 4-bit checkpoint: each decoder linear layer it quantized that the kernel takes
    (`int4_layout`) gets a packed weight to load into; returns how many. The rest keep their weight in the
    model's dtype, and the loader dequantizes into it (model/loader.py); experts: model/quant_experts.py."""
    count = 0
    for name, m in quantized_layers(model, quant):
        group = int4_layout(name, m, quant)
        if group is not None:
            dtype = m.weight.dtype
            m.prepare_int4(group, torch.float32 if dtype == torch.float32 else torch.float16)
            count += 1
    return count + prepare_experts_int4(model, quant)


def int4_layout(name: str, m: QuantizableLinear, quant: CheckpointQuant) -> int | None:
    """This rank's group size in the packed layout, or None where the layer stays dequantized: a row-parallel
    shard (TP > 1) of a desc_act checkpoint (its rows' groups are scattered over the ranks), or a group whose
    K tile would be under a dot's 16 rows. InvalidRequestError (naming tensor_parallel_size) for a
    row-parallel shard that would cut a group."""
    _, k, by_rows = m.checkpoint_parts()
    tp = getattr(m, "tp_size", 1)
    group = k if quant.group_size == -1 else quant.group_size
    if k % group:  # refused by the loader, once it has seen the checkpoint's tensors (model/loader.py)
        return None
    k_here = m.features()[1]
    if not by_rows and tp > 1:
        if quant.desc_act:
            return None
        if group != k and k_here % group:
            raise InvalidRequestError(
                f"tensor_parallel_size={tp} splits the 4-bit groups of layer {name} (group_size {group}): each "
                f"rank would hold {k_here} input columns, not a multiple of the group",
                "tensor_parallel_size",
            )
    group = min(group, k_here)  # one group over the whole input: each rank's shard of it
    return group if int4_k_tile(group) >= MIN_BLOCK_K else None


def check_blocks(name: str, m: QuantizableLinear, block: tuple[int, int], field: str, device: torch.device) -> None:
    """Whole blocks only: each checkpoint part's rows a multiple of bn and its columns of bk
    (InvalidRequestError naming `field`); this rank's shard of them too (naming tensor_parallel_size);
    on CUDA a K tile of at least 32 (an fp8 tensor-core dot's K)."""
    bn, bk = block
    parts, k, by_rows = m.checkpoint_parts()
    tp = getattr(m, "tp_size", 1)
    for rows in parts:
        if rows % bn or k % bk:
            raise InvalidRequestError(
                f"{field}={list(block)!r} does not tile layer {name} (a part of {rows} output rows x {k} input "
                "columns): pagedllm loads whole blocks only, rows a multiple of bn and columns of bk",
                field,
            )
        if (by_rows and (rows // tp) % bn) or (not by_rows and (k // tp) % bk):
            shard = f"{rows // tp} rows" if by_rows else f"{k // tp} columns"
            raise InvalidRequestError(
                f"tensor_parallel_size={tp} splits the {list(block)!r} blocks of {field} in layer {name}: "
                f"each rank would hold {shard}, not a multiple of the block",
                "tensor_parallel_size",
            )
    if device.type == "cuda" and block_k_tile(bk) < 32:
        raise InvalidRequestError(
            f"{field}={list(block)!r}: the GPU kernel needs the block's columns (bk) divisible by 32", field
        )


def prepare_quantization(
    model: nn.Module, hf_config, quantization: str | None, device: torch.device
) -> tuple[CheckpointQuant | None, str | None]:
    """Before the weights load: a quantized checkpoint's layers made ready for its format (refusing,
    naming the argument, a `quantization` that disagrees with it; load_format='dummy' fills them with
    random bytes of the format: model/loader.py), or the
    `quantization` to apply after loading ("fp8"; a checkpoint format with no quantization_config
    is refused). Returns the checkpoint's quantization and what is left to quantize after loading."""
    checkpoint_quant = read_quant_config(hf_config)  # refuses what it cannot load, naming the field
    if checkpoint_quant is not None:
        if quantization is not None and quantization != checkpoint_quant.method:
            raise InvalidRequestError(
                f"quantization={quantization!r} does not match the checkpoint's quantization_config "
                f"(quant_method {checkpoint_quant.method!r}): leave it unset or pass {checkpoint_quant.method!r}",
                "quantization",
            )
        if checkpoint_quant.int4:  # packed 4-bit weights where the kernel takes them
            prepare_checkpoint_int4(model, checkpoint_quant)
        else:
            prepare_checkpoint_fp8(model, checkpoint_quant, device)
        quantization = None  # loaded quantized: nothing to quantize after loading
    elif quantization is not None and quantization != "fp8":
        raise InvalidRequestError(
            f"quantization={quantization!r} names a checkpoint format, and this checkpoint has no "
            "quantization_config; quantization='fp8' quantizes an unquantized checkpoint at load",
            "quantization",
        )
    return checkpoint_quant, quantization
