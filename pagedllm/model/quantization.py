"""`quantization` (vLLM's argument): weights quantized when the model is loaded.

"fp8" quantizes every linear layer of the decoder layers (q/k/v, o, gate/up, down) to e4m3 with
one scale per output channel, as vLLM's on-the-fly FP8 does; embeddings, norms and the LM head
stay in the model's dtype. Activations are quantized per token at run time (ops/fp8_linear.py).
What it cannot do exactly is refused naming the argument: a mixture of experts (the fused-MoE
kernel takes unquantized experts) and a GPU without fp8 tensor cores (compute capability < 8.9).
A checkpoint that is already quantized (config.json's quantization_config, read by
model/quant_config.py) is loaded as it is: `prepare_checkpoint_fp8` makes its layers e4m3 before
the weights load into them (model/loader.py), its `ignore` list's layers staying unquantized.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.engine.config import QUANTIZATION_METHODS
from pagedllm.engine.errors import InvalidRequestError
from pagedllm.model.linear import QuantizableLinear
from pagedllm.model.moe import SparseMoeBlock
from pagedllm.model.quant_config import CheckpointQuant


def check_fp8_runs(model: nn.Module, device: torch.device, what: str, param: str) -> None:
    """FP8 linear layers need what they run on: refused (InvalidRequestError naming `param`) for a
    mixture of experts (the fused-MoE kernel takes unquantized experts) and a GPU without fp8 tensor
    cores (compute capability < 8.9)."""
    if any(isinstance(m, SparseMoeBlock) for m in model.modules()):
        raise InvalidRequestError(
            f"{what} on a mixture of experts: the fused-MoE kernel takes unquantized experts", param
        )
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise InvalidRequestError(
            f"{what} needs fp8 tensor cores (compute capability >= 8.9); this GPU has "
            f"{torch.cuda.get_device_capability(device)}",
            param,
        )


def quantize_linears(model: nn.Module, method: str, device: torch.device) -> int:
    """Quantize the model's decoder linear layers in place; returns how many. InvalidRequestError
    (param "quantization") for a method or a model it cannot quantize exactly."""
    if method not in QUANTIZATION_METHODS:
        raise InvalidRequestError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}", "quantization")
    check_fp8_runs(model, device, "quantization='fp8'", "quantization")
    layers = [m for m in model.modules() if isinstance(m, QuantizableLinear)]
    for m in layers:
        m.quantize_fp8()
    return len(layers)


def prepare_checkpoint_fp8(model: nn.Module, quant: CheckpointQuant, device: torch.device) -> int:
    """Before loading an FP8 checkpoint: every decoder linear layer it quantized gets an e4m3 weight
    and scales to load into; returns how many. A packed layer (qkv, gate_up) whose checkpoint parts
    are quantized and not is refused, as are a mixture of experts and a GPU without fp8 tensor cores."""
    check_fp8_runs(model, device, f"an FP8 checkpoint ({quant.method})", "quantization_config")
    packed = getattr(model, "packed_modules", {})
    count = 0
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
            m.prepare_fp8(quant.static_activations)
            count += 1
    return count
