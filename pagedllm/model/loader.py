"""Load a Hugging Face safetensors checkpoint (single file or sharded) into a model,
packing q/k/v and gate/up into their fused parameters and slicing for this TP rank. A
checkpoint that stores them packed already (Phi-3's qkv_proj, gate_up_proj) is cut into
q/k/v and gate/up first, so each rank takes its slice of each (linear.py). Mixture-of-experts
checkpoints name each expert's matrices; they are stacked into the experts' [E, ...] parameters
(model/moe.py), each rank taking its slice of every expert; a quantized checkpoint's experts load
their bytes and scales into quantized experts (model/moe_quant.py) where model/quant_experts.py made them.

A checkpoint made for an fp8 KV cache may carry per-layer KV scales (`...self_attn.k_scale`,
`v_scale`, or one `kv_scale` for both; also under `self_attn.attn.`): they are returned, by
attention layer, for the runner to use when the cache is fp8 (worker/kv_scales.py)."""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.model.attention import Attention
from pagedllm.model.int4_weights import PARTS as INT4_PARTS
from pagedllm.model.int4_weights import dequantize_awq, dequantize_gptq
from pagedllm.model.linear import QuantizableLinear
from pagedllm.model.moe import FusedExperts, expert_target
from pagedllm.model.moe_quant import Int4FusedExperts
from pagedllm.model.norm import RMSNorm
from pagedllm.model.parallel import ShardedModule
from pagedllm.model.quant_config import CheckpointQuant

if TYPE_CHECKING:
    from pagedllm.model.decoder import DecoderForCausalLM


# an FP8 checkpoint's scales (model/quant_config.py); block-wise `quant_method: "fp8"` names its
# weight scales `weight_scale_inv` (multipliers all the same), loaded into the layer's `weight_scale`
QUANT_SCALE_NAMES = ("weight_scale", "input_scale", "weight_scale_inv")


def checkpoint_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    return files


KV_SCALE_NAMES = {"k_scale": ("k_scale",), "v_scale": ("v_scale",), "kv_scale": ("k_scale", "v_scale")}


def _kv_scale(
    model: DecoderForCausalLM, layer_of: dict[Attention, int], name: str, tensor: torch.Tensor
) -> tuple[int, tuple[str, ...], float]:
    """(attention layer index, which scales, value) of a checkpoint's KV-scale tensor; layer_of:
    each attention layer's index."""
    owner_name, _, kind = name.rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
    except AttributeError:
        owner = None
    attn = next((m for m in owner.modules() if isinstance(m, Attention)), None) if owner is not None else None
    if attn is None:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    if tensor.numel() != 1:
        raise ValueError(
            f"checkpoint tensor {name!r} holds {tensor.numel()} KV scales; only one per layer (per tensor) is supported"
        )
    return layer_of[attn], KV_SCALE_NAMES[kind], float(tensor.float().reshape(()))


def load_weights(
    model: DecoderForCausalLM, model_dir: str, quant: CheckpointQuant | None = None
) -> dict[int, dict[str, float]]:
    """Load every weight; returns the checkpoint's KV scales, attention layer index -> {"k_scale": .., "v_scale": ..}.
    quant: the checkpoint's quantization (model/quant_config.py); a 4-bit layer's packed tensors are
    gathered, then loaded into its packed weight (model/int4_layer.py) or packed experts (model/moe_quant.py)
    or, where the layer has none (model/quantization.py: int4_layout, model/quant_experts.py), as the
    weight they mean (model/int4_weights.py)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = model.packed_modules
    loaded: set[str] = set()
    kv_scales: dict[int, dict[str, float]] = {}
    layer_of = {a: i for i, a in enumerate(model.attention_layers())}
    expert_shards: dict[str, set[int | None]] = {}  # stacked experts' parameter -> the shards loaded into it
    int4: dict[str, dict[str, torch.Tensor]] = {}  # layer -> its packed parts (AWQ, GPTQ)
    tensors = _checkpoint_tensors(model_dir)
    for name, get in tensors:
        if quant is not None and quant.int4 and name.rpartition(".")[2] in INT4_PARTS:
            prefix, _, part = name.rpartition(".")
            int4.setdefault(prefix, {})[part] = get()
            continue
        if "rotary_emb.inv_freq" in name:
            continue
        if quant is not None and quant.int4 and name.endswith(".weight"):
            _refuse_plain_weight_of_int4_layer(model, packed, name, quant)
        _place(model, params, packed, layer_of, loaded, kv_scales, expert_shards, name, get)
    if quant is not None and quant.int4 and not int4:
        raise InvalidRequestError(
            f"the checkpoint's quantization_config.quant_method={quant.method!r}, but it holds no 4-bit weights "
            "(qweight, qzeros, scales): its config and its tensors disagree",
            "quantization_config",
        )
    for prefix, parts in int4.items():
        assert quant is not None
        _check_int4_parts(prefix, parts, quant)
        expert = expert_target(prefix + ".weight")
        experts = _owner(model, expert[0]) if expert is not None else None
        if expert is not None and isinstance(experts, Int4FusedExperts):  # packed 4-bit experts
            experts_name, _, param_name = expert[0].rpartition(".")
            with torch.no_grad():
                experts.load_int4(prefix, parts, expert[1], quant.method, quant.zero_offset)
            expert_shards.setdefault(f"{experts_name}.{param_name.partition('_')[0]}_qweight", set()).add(expert[1])
            loaded.update(f"{experts_name}.{p}" for p, _ in experts.named_parameters())
            continue
        owner_name, shard = _int4_owner(model, packed, prefix)
        owner = model.get_submodule(owner_name) if owner_name else None
        if isinstance(owner, QuantizableLinear) and owner.int4 is not None:
            with torch.no_grad():
                owner.load_int4(prefix, parts, shard, quant.method, quant.zero_offset)
            loaded.update(f"{owner_name}.int4.{p}" for p, _ in owner.int4.named_parameters())
            continue
        weight = _dequantize(prefix, parts, quant)
        _place(
            model, params, packed, layer_of, loaded, kv_scales, expert_shards, prefix + ".weight", lambda w=weight: w
        )
    missing = {n for n in params if n not in loaded}
    for target, shards in expert_shards.items():  # every expert's every matrix, or the packed tensor
        owner_name, _, param_name = target.rpartition(".")
        owner = model.get_submodule(owner_name)
        if None not in shards and isinstance(owner, FusedExperts) and len(shards) < owner.num_shards(param_name):
            missing.add(f"{target} ({owner.num_shards(param_name) - len(shards)} expert matrices)")
    if model.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for {sorted(missing)[:5]}")
    return kv_scales


def _checkpoint_tensors(model_dir: str):
    """(name, a function that reads it) for every tensor of the checkpoint, file by file (the file
    stays open while its names are handed out)."""
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, (lambda f=f, name=name: f.get_tensor(name))


def _check_int4_parts(prefix: str, parts: dict[str, torch.Tensor], quant: CheckpointQuant) -> None:
    missing = [p for p in ("qweight", "qzeros", "scales") if p not in parts]
    if missing:
        raise ValueError(f"checkpoint layer {prefix!r} lacks {', '.join(missing)} of its {quant.method} weight")
    rows = parts["qweight"].shape[0] * (1 if quant.method == "awq" else 8)  # GPTQ packs 8 input rows a word
    groups = parts["scales"].shape[0]
    if rows % groups:
        raise InvalidRequestError(
            f"quantization_config.group_size={quant.group_size}: checkpoint layer {prefix!r} has {groups} groups "
            f"of scales over {rows} input rows; pagedllm loads groups of equal size only",
            "quantization_config.group_size",
        )


def _refuse_plain_weight_of_int4_layer(model: DecoderForCausalLM, packed, name: str, quant: CheckpointQuant) -> None:
    owner_name, _ = _int4_owner(model, packed, name.removesuffix(".weight"))
    owner = model.get_submodule(owner_name) if owner_name else None
    if isinstance(owner, QuantizableLinear) and owner.int4 is not None:
        raise InvalidRequestError(
            f"checkpoint tensor {name!r} is a plain weight, but its layer is 4-bit under the checkpoint's "
            f"quantization_config.quant_method={quant.method!r} (qweight, qzeros, scales): its config and its "
            "tensors disagree",
            "quantization_config",
        )


def _owner(model: DecoderForCausalLM, param: str):
    """The module holding parameter `param` (a model name), or None."""
    try:
        return model.get_submodule(param.rpartition(".")[0])
    except AttributeError:
        return None


def _int4_owner(model: DecoderForCausalLM, packed, prefix: str) -> tuple[str | None, int | str | None]:
    """(the model's layer that a 4-bit checkpoint layer loads into, its shard of a packed layer); (None,
    None) for experts and names with no layer (the dequantizing path places or refuses them; packed 4-bit
    experts load before, model/moe_quant.py)."""
    name = prefix + ".weight"
    if expert_target(name) is not None:
        return None, None
    target, shard = _packed_target(packed, name)
    owner_name = target.rpartition(".")[0]
    try:
        model.get_submodule(owner_name)
    except AttributeError:
        return None, None
    return owner_name, shard


def _packed_target(packed, name: str) -> tuple[str, int | str | None]:
    """(the model's parameter, shard id) of a checkpoint name: q/k/v and gate/up go into their packed layer."""
    for ckpt_part, (packed_part, shard_id) in packed.items():
        if f".{ckpt_part}." in name:
            return name.replace(f".{ckpt_part}.", f".{packed_part}."), shard_id
    return name, None


def _dequantize(prefix: str, parts: dict[str, torch.Tensor], quant: CheckpointQuant) -> torch.Tensor:
    """A 4-bit layer's weight [out, in] from its packed parts (model/int4_weights.py)."""
    if quant.method == "awq":
        return dequantize_awq(parts["qweight"], parts["qzeros"], parts["scales"])
    return dequantize_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), quant.zero_offset)


def _place(model, params, packed, layer_of, loaded, kv_scales, expert_shards, name: str, get) -> None:
    """One checkpoint tensor into its place: a KV scale, a (packed, sharded, stacked-expert) weight, or a
    quantized layer's scale."""
    if name.rpartition(".")[2] in KV_SCALE_NAMES:
        layer, kinds, value = _kv_scale(model, layer_of, name, get())
        for kind in kinds:
            kv_scales.setdefault(layer, {})[kind] = value
        return
    if name == "lm_head.weight" and model.tie_word_embeddings:
        return
    target: str
    shard: int | str | None
    expert = expert_target(name)  # MoE: one expert's matrix (or all, packed) into the stacked experts
    if expert is not None:
        target, shard = expert
        expert_shards.setdefault(target, set()).add(expert[1])
    else:
        target, shard = _packed_target(packed, name)
    key = target.removesuffix("_inv") if target.endswith(".weight_scale_inv") else target  # the parameter
    param = params.get(key)
    if param is None:
        if name.rpartition(".")[2] in QUANT_SCALE_NAMES:  # a quantized layer the model keeps unquantized
            raise InvalidRequestError(
                f"checkpoint tensor {name!r}: its layer is quantized, but pagedllm quantizes only the "
                "decoder layers' linear layers and experts (not embeddings, the LM head or the router); list "
                "it in quantization_config's ignore list only if its weight is unquantized",
                "quantization_config",
            )
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    tensor = get()
    if param.dtype == torch.float8_e4m3fn and tensor.dtype != param.dtype:  # a copy would quantize it unscaled
        raise InvalidRequestError(
            f"checkpoint tensor {name!r} is {tensor.dtype}, but the checkpoint's quantization_config makes "
            "its layer e4m3: its config and its tensors disagree",
            "quantization_config",
        )
    owner_name, _, param_name = target.rpartition(".")
    owner = model.get_submodule(owner_name)
    with torch.no_grad():
        if param_name in QUANT_SCALE_NAMES and isinstance(owner, QuantizableLinear):
            owner.load_scale(param_name, tensor, shard)
        elif isinstance(owner, ShardedModule):  # this rank's slice / the packed shard
            owner.load_weight(param_name, tensor, shard)
        else:  # replicated (norms)
            param.data.copy_(tensor)
    loaded.add(key)


def init_dummy_weights(model: DecoderForCausalLM, seed: int, std: float = 0.02) -> dict[int, dict[str, float]]:
    """load_format="dummy": every weight matrix normal(0, std), norms as built (scale 1), biases 0, drawn on
    the parameters' device from one seeded generator in model order (so every TP rank draws the
    same replicated weights: the router and norms agree across ranks). No checkpoint is read;
    returns no KV scales. For benchmarks of shapes too large to write to disk.

    A quantized checkpoint's layers (prepared by model/quantization.py) get bytes of the same
    spread: e4m3 weights normal(0, 1) with scales `std` (per channel or block), 4-bit weights
    uniform over the 16 levels with zero point 8 and scales std / 4.6 (the levels' spread), static
    activation scales 0.05. Their speed is the format's; their numbers mean nothing."""
    norms = {id(p) for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters(recurse=False)}
    generator: torch.Generator | None = None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if generator is None:
                generator = torch.Generator(device=param.device).manual_seed(seed)
            if id(param) in norms:
                continue
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "bias":
                param.zero_()
            elif param.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                flat = param.data.view(param.shape[0], -1)  # in chunks of rows: no float32 copy of it all,
                step = max(1, (1 << 24) // flat.shape[1])  # and not a launch per row (millions for a 32B model)
                for chunk in flat.split(step):
                    chunk.copy_(torch.randn(chunk.shape, generator=generator, device=chunk.device).clamp(-448, 448))
            elif leaf.endswith("perm"):  # an input order (GPTQ desc_act): the identity
                param.copy_(torch.arange(param.shape[-1], device=param.device).expand(param.shape))
            elif leaf.endswith("qweight"):  # eight 4-bit levels per int32, uniform over 0..15
                param.copy_(torch.randint(-(2**31), 2**31 - 1, param.shape, generator=generator, device=param.device))
            elif leaf.endswith("qzeros"):
                param.fill_(8)
            elif leaf.endswith("weight_scale"):
                param.fill_(std)
            elif leaf.endswith("scales"):
                param.fill_(std / 4.6)
            elif leaf.endswith("input_scale"):
                param.fill_(0.05)
            else:
                param.normal_(0.0, std, generator=generator)
    return {}
