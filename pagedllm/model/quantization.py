"""`quantization` (vLLM's argument): weights quantized when the model is loaded.

"fp8" quantizes every linear layer of the decoder layers (q/k/v, o, gate/up, down) to e4m3 with
one scale per output channel, as vLLM's on-the-fly FP8 does; embeddings, norms and the LM head
stay in the model's dtype. Activations are quantized per token at run time (ops/fp8_linear.py).
What it cannot do exactly is refused naming the argument: a mixture of experts (the fused-MoE
kernel takes unquantized experts) and a GPU without fp8 tensor cores (compute capability < 8.9).
Checkpoints that are already quantized (config.json's quantization_config) are refused in
registry.check_supported.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.engine.config import QUANTIZATION_METHODS
from pagedllm.engine.errors import InvalidRequestError
from pagedllm.model.linear import QuantizableLinear
from pagedllm.model.moe import SparseMoeBlock


def quantize_linears(model: nn.Module, method: str, device: torch.device) -> int:
    """Quantize the model's decoder linear layers in place; returns how many. InvalidRequestError
    (param "quantization") for a method or a model it cannot quantize exactly."""
    if method not in QUANTIZATION_METHODS:
        raise InvalidRequestError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}", "quantization")
    if any(isinstance(m, SparseMoeBlock) for m in model.modules()):
        raise InvalidRequestError(
            "quantization='fp8' on a mixture of experts: the fused-MoE kernel takes unquantized experts",
            "quantization",
        )
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise InvalidRequestError(
            f"quantization='fp8' needs fp8 tensor cores (compute capability >= 8.9); this GPU has "
            f"{torch.cuda.get_device_capability(device)}",
            "quantization",
        )
    layers = [m for m in model.modules() if isinstance(m, QuantizableLinear)]
    for m in layers:
        m.quantize_fp8()
    return len(layers)
