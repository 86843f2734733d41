"""A checkpoint's own quantization (config.json's `quantization_config`), read into one spec.

Loaded: FP8 weights (e4m3) with one scale per output channel or one per tensor, and activations
quantized at run time, dynamically per token or statically with the checkpoint's per-tensor
`input_scale`, in the two layouts that publish them:

- `quant_method: "fp8"` (HF transformers' and vLLM's FP8 config) without `weight_block_size`:
  `activation_scheme` "dynamic" or "static", `weight_scale` per tensor; `ignored_layers` /
  `modules_to_not_convert` stay in the model's dtype;
- `quant_method: "compressed-tensors"` with `format: "float-quantized"` (the "-FP8-dynamic" and
  "-FP8" checkpoints): one config group of 8-bit float weights, `strategy` "channel" or "tensor",
  symmetric; `input_activations` dynamic per token or static per tensor; `ignore` stays unquantized.

Block-wise FP8 (ops/fp8_block_linear.py): e4m3 weights with one scale per [bn, bk] block and
activations quantized dynamically per token and group of bk columns:

- `quant_method: "fp8"` with `weight_block_size: [bn, bk]` (Qwen3-*-FP8, DeepSeek-V3): the scales
  are `weight_scale_inv` [N / bn, K / bk] (the multiplier, despite the name); `activation_scheme`
  must be "dynamic";
- compressed-tensors with weights `strategy: "block"`, `block_structure: [bn, bk]` (`weight_scale`)
  and `input_activations` dynamic, `strategy: "group"`, `group_size` bk.
Every block layer's N and K (and TP shard) must be multiples of the block: model/quantization.py.

4-bit AWQ (`version: "gemm"`, with zero points) and GPTQ (`checkpoint_format` "gptq" or "gptq_v2",
`desc_act` and `sym` either way), any group size that divides the layers' inputs: their weights stay
packed for a 4-bit kernel (model/int4_layer.py, ops/int4_linear.py), or are dequantized at load where
the kernel cannot take them (model/quantization.py: int4_layout).

Everything else is refused at start-up naming the field and its value (an `InvalidRequestError`
whose `param` is the field's path), never loaded to compute something else: weight-only FP8,
group FP8 strategies, block sizes that are not two positive integers, other bit widths and the other
methods; static activations with block-wise weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NoReturn

from pagedllm.engine.errors import InvalidRequestError

LOADED_METHODS = ("fp8", "compressed-tensors", "awq", "gptq")  # the quant_method values read here


@dataclass(frozen=True)
class CheckpointQuant:
    method: str  # "fp8", "compressed-tensors", "awq" or "gptq"
    per_tensor_weights: bool = False  # FP8: else one scale per output channel
    static_activations: bool = False  # FP8: else dynamic, one scale per token
    ignore: tuple[str, ...] = ()  # checkpoint module names (or "re:" patterns) left unquantized
    int4: bool = False  # AWQ / GPTQ: 4-bit weights (model/int4_layer.py)
    zero_offset: int = 0  # GPTQ's original format stores zero points minus one
    group_size: int = 0  # 4-bit: input rows per scale (-1: one group over the whole input)
    desc_act: bool = False  # GPTQ: groups over a permutation of the input rows (g_idx)
    weight_block: tuple[int, int] | None = None  # block-wise FP8: [bn, bk], one weight scale per block
    block_field: str = ""  # the config field that says the block (for refusals naming it)
    activations_field: str = ""  # FP8: the config field that says the activations' scheme (ditto)

    def ignores(self, module: str) -> bool:
        """Is this checkpoint module (e.g. "model.layers.0.self_attn.q_proj") left unquantized?"""
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.fullmatch(pat[3:], module):
                    return True
            elif module == pat or module.endswith("." + pat) or pat == module.rpartition(".")[2]:
                return True
        return False


def _refuse(field: str, value: Any, why: str) -> NoReturn:
    raise InvalidRequestError(
        f"quantization_config.{field}={value!r} is not supported: {why}", f"quantization_config.{field}"
    )


def _as_dict(quant: Any) -> dict[str, Any]:
    if isinstance(quant, dict):
        return quant
    to_dict = getattr(quant, "to_dict", None)
    return dict(to_dict()) if callable(to_dict) else dict(vars(quant))


def read_quant_config(cfg: Any) -> CheckpointQuant | None:
    """The checkpoint's quantization, or None for an unquantized checkpoint. InvalidRequestError
    naming `quantization_config.<field>` for what cannot be loaded exactly."""
    quant = getattr(cfg, "quantization_config", None)
    if not quant:
        return None
    q = _as_dict(quant)
    method = q.get("quant_method")
    method = str(getattr(method, "value", method))
    if method == "fp8":
        return _read_fp8(q)
    if method == "compressed-tensors":
        return _read_compressed_tensors(q)
    if method in ("awq", "gptq"):
        return _read_int4(method, q)
    _refuse("quant_method", method, f"pagedllm loads {', '.join(LOADED_METHODS)} checkpoints and unquantized weights")
    return None  # unreachable


def _block(field: str, value: Any) -> tuple[int, int]:
    """[bn, bk]: two positive integers (rows of W per scale, columns of W per scale)."""
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        _refuse(field, value, "a block is two positive integers [rows, columns]")
    return int(value[0]), int(value[1])


def _read_fp8(q: dict[str, Any]) -> CheckpointQuant:
    if q.get("fmt", "e4m3") != "e4m3":
        _refuse("fmt", q.get("fmt"), "FP8 weights are read as e4m3")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        _refuse("activation_scheme", scheme, "activations are quantized dynamically (per token) or statically")
    ignore = tuple(q.get("ignored_layers") or q.get("modules_to_not_convert") or ())
    if q.get("weight_block_size") is not None:
        block = _block("weight_block_size", q["weight_block_size"])
        if scheme != "dynamic":
            _refuse("activation_scheme", scheme, "block-wise weights take dynamic activations (per token and group)")
        return CheckpointQuant(
            "fp8", ignore=ignore, weight_block=block, block_field="quantization_config.weight_block_size"
        )
    return CheckpointQuant(
        "fp8",
        per_tensor_weights=True,
        static_activations=scheme == "static",
        ignore=ignore,
        activations_field="quantization_config.activation_scheme",
    )


def _read_compressed_tensors(q: dict[str, Any]) -> CheckpointQuant:
    fmt = q.get("format")
    if fmt != "float-quantized":
        _refuse("format", fmt, "compressed-tensors checkpoints are read in the float-quantized (FP8) format")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        _refuse("config_groups", sorted(groups), "one config group (one scheme for every Linear) is supported")
    name, group = next(iter(groups.items()))
    at = f"config_groups.{name}"
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        _refuse(f"{at}.targets", targets, 'the scheme must target every "Linear"')
    w = group.get("weights") or {}
    if w.get("num_bits") != 8 or w.get("type") != "float":
        _refuse(f"{at}.weights", {k: w.get(k) for k in ("num_bits", "type")}, "8-bit float weights (FP8 e4m3) only")
    if w.get("strategy") not in ("channel", "tensor", "block"):
        _refuse(f"{at}.weights.strategy", w.get("strategy"), 'one scale per output "channel", "tensor" or "block"')
    if w.get("symmetric") is False:
        _refuse(f"{at}.weights.symmetric", False, "FP8 weights are symmetric (no zero point)")
    if w.get("dynamic"):
        _refuse(f"{at}.weights.dynamic", True, "weight scales are read from the checkpoint")
    a = group.get("input_activations")
    if not a:
        _refuse(f"{at}.input_activations", a, "weight-only FP8 is not implemented: activations must be FP8 too")
    if a.get("num_bits") != 8 or a.get("type") != "float":
        _refuse(f"{at}.input_activations", {k: a.get(k) for k in ("num_bits", "type")}, "8-bit float activations only")
    if w["strategy"] == "block":
        return _read_compressed_block(q, at, w, a)
    if a.get("dynamic"):
        if a.get("strategy") not in ("token", None):
            _refuse(f"{at}.input_activations.strategy", a.get("strategy"), 'dynamic activations are scaled per "token"')
        static = False
    else:
        if a.get("strategy") != "tensor":
            _refuse(f"{at}.input_activations.strategy", a.get("strategy"), 'static activations have one "tensor" scale')
        static = True
    return CheckpointQuant(
        "compressed-tensors",
        per_tensor_weights=w["strategy"] == "tensor",
        static_activations=static,
        ignore=tuple(q.get("ignore") or ()),
        activations_field=f"quantization_config.{at}.input_activations",
    )


def _read_compressed_block(q: dict[str, Any], at: str, w: dict[str, Any], a: dict[str, Any]) -> CheckpointQuant:
    """compressed-tensors' FP8 block scheme: weights per `block_structure`, activations per token group."""
    block = _block(f"{at}.weights.block_structure", w.get("block_structure"))
    if not a.get("dynamic"):
        _refuse(f"{at}.input_activations.dynamic", a.get("dynamic"), "block-wise weights take dynamic activations")
    if a.get("strategy") != "group":
        _refuse(
            f"{at}.input_activations.strategy", a.get("strategy"), 'block-wise weights take per-token "group" scales'
        )
    if a.get("group_size") != block[1]:
        _refuse(f"{at}.input_activations.group_size", a.get("group_size"), f"the weight block's columns ({block[1]})")
    return CheckpointQuant(
        "compressed-tensors",
        ignore=tuple(q.get("ignore") or ()),
        weight_block=block,
        block_field=f"quantization_config.{at}.weights.block_structure",
    )


def _read_int4(method: str, q: dict[str, Any]) -> CheckpointQuant:
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        _refuse("bits", bits, "4-bit AWQ and GPTQ weights only")
    group = q.get("group_size", q.get("q_group_size"))
    if not isinstance(group, int) or (group < 1 and group != -1):
        _refuse("group_size", group, "a positive group size, or -1 (one group over the whole input)")
    if method == "awq":
        if str(q.get("version", "gemm")).lower() != "gemm":
            _refuse("version", q.get("version"), 'the AWQ "gemm" layout only')
        if q.get("zero_point") is False:
            _refuse("zero_point", False, "AWQ checkpoints with zero points only")
        return CheckpointQuant("awq", int4=True, group_size=group, ignore=tuple(q.get("modules_to_not_convert") or ()))
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        _refuse("checkpoint_format", fmt, 'the "gptq" and "gptq_v2" layouts only')
    return CheckpointQuant(
        "gptq",
        int4=True,
        zero_offset=1 if fmt == "gptq" else 0,
        group_size=group,
        desc_act=bool(q.get("desc_act", False)),
        ignore=tuple(q.get("modules_to_not_convert") or ()),
    )
