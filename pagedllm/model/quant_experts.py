"""A quantized checkpoint's experts: which layers' experts it quantized, whether pagedllm's kernels take
them as they are, and the quantized FusedExperts (model/moe_quant.py) they load into.

The checkpoint names its experts one by one (`mlp.experts.E.gate_proj`, Mixtral's
`block_sparse_moe.experts.E.w1`); a layer's experts are quantized unless the config's ignore list
names them (all of them, or none: a layer whose experts are partly listed is refused). The router
(`mlp.gate`) is a plain linear layer in the model's dtype: checkpoints list it in their ignore list.

FP8 (block-wise or per row): whole blocks only, in every expert matrix and in this rank's slice of the
intermediate dimension (else refused naming the field, or tensor_parallel_size), dynamic activations
only (static ones refused naming the field). 4-bit (AWQ, GPTQ): packed where the kernel takes them;
left in the model's dtype, for the loader to dequantize (model/loader.py), where a group's K tile
would be under a dot's 16 rows, or GPTQ's desc_act under TP (its down matrices' groups are scattered
over the ranks); a TP slice that would cut a group is refused naming tensor_parallel_size.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.model.moe import SparseMoeBlock
from pagedllm.model.moe_quant import Fp8FusedExperts, Int4FusedExperts
from pagedllm.model.parallel import tp_size
from pagedllm.model.quant_config import CheckpointQuant
from pagedllm.ops.fp8_block_linear import block_k_tile
from pagedllm.ops.int4_linear import MIN_BLOCK_K
from pagedllm.ops.int4_linear import block_k_tile as int4_k_tile


def quantized_moe_blocks(model: nn.Module, quant: CheckpointQuant) -> list[tuple[str, SparseMoeBlock]]:
    """The MoE layers whose experts the checkpoint quantized (not in its ignore list)."""
    out = []
    for name, moe in model.named_modules():
        if not isinstance(moe, SparseMoeBlock):
            continue
        owner = name.rpartition(".")[0] + (".block_sparse_moe" if moe.kind == "mixtral" else ".mlp")
        projs = ("w1", "w3", "w2") if moe.kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        names = [f"{owner}.experts.{e}.{p}" for e in range(moe.experts.num_experts) for p in projs]
        ignored = {quant.ignores(n) for n in names}
        if ignored == {True, False}:
            raise InvalidRequestError(
                f"quantization_config.ignore={list(quant.ignore)!r} leaves some of the experts of {owner} "
                f"unquantized ({next(n for n in names if quant.ignores(n))}, ...): a layer's experts must be "
                "quantized alike",
                "quantization_config.ignore",
            )
        if ignored == {False}:
            out.append((name, moe))
    return out


def prepare_experts_fp8(model: nn.Module, quant: CheckpointQuant, device: torch.device) -> int:
    """FP8 experts (e4m3 and scales) for every MoE layer the checkpoint quantized; returns how many."""
    blocks = quantized_moe_blocks(model, quant)
    for name, moe in blocks:
        if quant.static_activations:
            raise InvalidRequestError(
                f"{quant.activations_field}: static activation scales are not supported for a mixture of "
                f"experts' experts ({name}.experts): pagedllm quantizes their activations dynamically",
                quant.activations_field,
            )
        if quant.weight_block is not None:
            check_expert_blocks(name, moe, quant.weight_block, quant.block_field, device)
        moe.experts = Fp8FusedExperts(moe.experts, quant.weight_block, quantize=False)
    return len(blocks)


def check_expert_blocks(
    name: str, moe: SparseMoeBlock, block: tuple[int, int], field: str, device: torch.device
) -> None:
    """Whole blocks: gate/up [I, H] and down [H, I] tiled by [bn, bk] (InvalidRequestError naming `field`);
    this rank's n = I / tp rows of gate/up and columns of down too (naming tensor_parallel_size); on CUDA
    a K tile of at least 32 (an fp8 tensor-core dot's K)."""
    bn, bk = block
    hidden, inter, n = moe.experts.w13_weight.shape[2], moe.experts.intermediate, moe.experts.inter_per_rank
    if inter % bn or hidden % bk or hidden % bn or inter % bk:
        raise InvalidRequestError(
            f"{field}={list(block)!r} does not tile the experts of layer {name} (gate/up {inter} x {hidden}, "
            f"down {hidden} x {inter}): pagedllm loads whole blocks only",
            field,
        )
    if n % bn or n % bk:
        raise InvalidRequestError(
            f"tensor_parallel_size={tp_size()} splits the {list(block)!r} blocks of {field} in the experts of "
            f"layer {name}: each rank would hold {n} of their {inter} intermediate rows, not a multiple of the block",
            "tensor_parallel_size",
        )
    if device.type == "cuda" and block_k_tile(bk) < 32:
        raise InvalidRequestError(
            f"{field}={list(block)!r}: the GPU kernel needs the block's columns (bk) divisible by 32", field
        )


def prepare_experts_int4(model: nn.Module, quant: CheckpointQuant) -> int:
    """Packed 4-bit experts for every MoE layer the checkpoint quantized where the kernel takes them
    (`experts_int4_groups`); returns how many."""
    count = 0
    for name, moe in quantized_moe_blocks(model, quant):
        groups = experts_int4_groups(name, moe, quant)
        if groups is not None:
            dtype = torch.float32 if moe.experts.w13_weight.dtype == torch.float32 else torch.float16
            moe.experts = Int4FusedExperts(moe.experts, groups, dtype, quant.desc_act)
            count += 1
    return count


def experts_int4_groups(name: str, moe: SparseMoeBlock, quant: CheckpointQuant) -> tuple[int, int] | None:
    """This rank's group sizes (w13 over H, w2 over its n rows) in the packed layout, or None where the
    experts stay in the model's dtype, dequantized at load. InvalidRequestError (naming
    tensor_parallel_size) where this rank's slice would cut a group."""
    hidden, inter, n = moe.experts.w13_weight.shape[2], moe.experts.intermediate, moe.experts.inter_per_rank
    g13 = hidden if quant.group_size == -1 else quant.group_size
    g2 = inter if quant.group_size == -1 else quant.group_size
    if hidden % g13 or inter % g2:  # refused by the loader, once it has seen the checkpoint's tensors
        return None
    if n != inter:
        if quant.desc_act:
            return None
        if g2 != inter and n % g2:
            raise InvalidRequestError(
                f"tensor_parallel_size={tp_size()} splits the 4-bit groups of the experts of layer {name} "
                f"(group_size {g2}): each rank would hold {n} of their {inter} intermediate rows, not a multiple "
                "of the group",
                "tensor_parallel_size",
            )
    g2 = min(g2, n)  # one group over the whole input: each rank's slice of it
    return (g13, g2) if min(int4_k_tile(g13), int4_k_tile(g2)) >= MIN_BLOCK_K else None
