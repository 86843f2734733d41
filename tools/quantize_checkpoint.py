"""Write an FP8 checkpoint of an unquantized Hugging Face model directory, in the layouts pagedllm
loads (model/quant_config.py): the test checkpoints, and a way to make one without other tools.

Every decoder linear weight (q/k/v/o, gate/up/down, Phi-3's packed qkv_proj / gate_up_proj, and a
mixture of experts' experts: mlp.experts.E.gate_proj..., Mixtral's block_sparse_moe.experts.E.w1/w3/w2)
becomes e4m3 with scale = max|W| / 448 per output channel (`--weights channel`) or per tensor
(`--weights tensor`), W_q = saturate(W / scale), stored beside it as `weight_scale`; embeddings, norms,
the LM head and MoE routers (mlp.gate) stay as they are (listed in the config's ignore list).
`--activations dynamic` quantizes activations per token at run time; `static` stores one `input_scale`
per layer, the constant `--input-scale` (no calibration run: a test value, not a tuned one).

    python tools/quantize_checkpoint.py --model DIR --out DIR [--format compressed-tensors|fp8|fp8-block]
        [--weights channel|tensor|block] [--block-size 128 [128]] [--activations dynamic|static] [--input-scale 0.05]

`--format fp8` writes HF transformers' / vLLM's `quant_method: "fp8"` layout, which has per-tensor
weight scales only. `--format fp8-block` writes the block-wise one of Qwen3-*-FP8 and DeepSeek-V3
(`weight_block_size: [bn, bk]` from `--block-size`, one scale per block, stored as
`weight_scale_inv` [ceil(N / bn), ceil(K / bk)], the multiplier; dynamic activations only), and
`--weights block` the same blocks in compressed-tensors' layout (`weight_scale`, per-token-group
activations). `--format awq|gptq` writes 4-bit weights with a scale and zero point per
`--group-size` input rows (round to nearest, no calibration): AWQ's "gemm" layout, or GPTQ's
original one (`--sym`, `--desc-act` for a permuted group order with its g_idx); the packing is
model/int4_weights.py's, read backwards.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an AWQ int32 holds output column AWQ_ORDER[k]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
EXPERT_LINEARS = ("w1", "w2", "w3")  # Mixtral's experts (block_sparse_moe.experts.E.w1); the router stays as it is
FP8 = torch.float8_e4m3fn


def quantize(w: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale [N, 1] per channel or [1] per tensor)."""
    wf = w.float()
    amax = wf.abs().amax() if per_tensor else wf.abs().amax(dim=1, keepdim=True)
    scale = (amax / 448.0).clamp(min=1e-12)
    q = (wf / scale).clamp(-448.0, 448.0).to(FP8)
    return q.contiguous(), scale.reshape(1) if per_tensor else scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale [ceil(N / bn), ceil(K / bk)]): scale = max|W| / 448 over each block
    (a partial last block over the rows and columns it has)."""
    (bn, bk), (n, k) = block, w.shape
    padded = F.pad(w.float(), (0, -k % bk, 0, -n % bn))  # zeros leave every block's max as it is
    tiles = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (tiles / scale[:, None, :, None]).clamp(-448.0, 448.0).to(FP8).view(padded.shape)[:n, :k]
    return q.contiguous(), scale


def int4_groups(
    w: torch.Tensor, group: int, sym: bool, min_zero: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] -> (q [in, out] 0..15, zeros [groups, out], scales [groups, out]), groups of `group`
    consecutive input rows: asymmetric scale = (max - min) / 15, zero = round(-min / scale); symmetric
    scale = max|W| / 7.5, zero 8 (GPTQ's). `min_zero` 1 (GPTQ's original format, which stores zero - 1
    in 4 bits and so cannot hold a zero of 0): a group with no negative weight gets zero 1 and
    scale max / 14 instead."""
    wt = w.float().t()  # [in, out]
    rows, out = wt.shape
    g = wt.reshape(rows // group, group, out)
    if sym:
        scale = (g.abs().amax(dim=1) / 7.5).clamp(min=1e-8)
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = g.amin(dim=1).clamp(max=0), g.amax(dim=1).clamp(min=0)
        scale = ((hi - lo) / 15.0).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, 15)
        low = zero < min_zero
        scale = torch.where(low, (hi / (15 - min_zero)).clamp(min=1e-8), scale)
        zero = torch.where(low, torch.full_like(zero, float(min_zero)), zero)
    q = torch.round(g / scale[:, None] + zero[:, None]).clamp(0, 15).reshape(rows, out)
    return q.to(torch.int32), zero.to(torch.int32), scale.half()


def pack_cols(v: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int [rows, cols] -> int32 [rows, cols / 8]: nibble k of each int32 holds column order[k] of its eight."""
    v = v.reshape(v.shape[0], -1, 8)[..., list(order)].to(torch.int64)
    packed = sum(v[..., k] << (4 * k) for k in range(8))
    return (packed - ((packed >> 31) & 1) * (1 << 32)).to(torch.int32)  # the two's-complement int32


def pack_rows(v: torch.Tensor) -> torch.Tensor:
    """int [rows, cols] -> int32 [rows / 8, cols]: row i at bits 4 (i % 8) (GPTQ's qweight)."""
    return pack_cols(v.t().contiguous(), tuple(range(8))).t().contiguous()


def int4_tensors(w: torch.Tensor, fmt: str, group: int, sym: bool, desc_act: bool) -> dict[str, torch.Tensor]:
    """A linear weight's AWQ ("gemm") or GPTQ (original format: zeros stored minus one) tensors."""
    rows = w.shape[1]
    group = rows if group == -1 else group
    if fmt == "awq":
        q, zero, scale = int4_groups(w, group, sym=False)
        return {"qweight": pack_cols(q, AWQ_ORDER), "qzeros": pack_cols(zero, AWQ_ORDER), "scales": scale}
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(rows)) if desc_act else torch.arange(rows)
    # groups of consecutive rows in the permuted order; zeros >= 1 (stored minus one in 4 bits)
    q_p, zero, scale = int4_groups(w[:, perm], group, sym, min_zero=1)
    q = torch.empty_like(q_p)
    q[perm] = q_p  # back in the input's order; each row keeps its group
    g_idx = torch.empty(rows, dtype=torch.int32)
    g_idx[perm] = (torch.arange(rows) // group).to(torch.int32)
    stored = (zero - 1) & 0xF  # GPTQ's original format: zero - 1, in its own nibble
    return {"qweight": pack_rows(q), "qzeros": pack_cols(stored, tuple(range(8))), "scales": scale, "g_idx": g_idx}


def is_linear(name: str) -> bool:
    parts = name.split(".")
    expert = parts[-2] in EXPERT_LINEARS and ".experts." in name
    return len(parts) >= 2 and parts[-1] == "weight" and (parts[-2] in LINEARS or expert) and ".layers." in name


def routers(config: dict) -> list[str]:
    """A mixture of experts' router modules (left unquantized, listed in the ignore list as checkpoints
    list them); none for a dense model."""
    if not (config.get("num_experts") or config.get("num_local_experts")):
        return []
    mlp = "block_sparse_moe" if config.get("model_type") == "mixtral" else "mlp"
    return [f"model.layers.{i}.{mlp}.gate" for i in range(config["num_hidden_layers"])]


def quantization_config(
    fmt: str,
    weights: str,
    static: bool,
    group: int = 128,
    sym: bool = False,
    desc_act: bool = False,
    block: tuple[int, int] = (128, 128),
    unquantized: tuple[str, ...] = (),
) -> dict:
    """unquantized: modules besides lm_head that the checkpoint leaves in their dtype (MoE routers)."""
    if fmt == "fp8-block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
            "modules_to_not_convert": ["lm_head", *unquantized],
        }
    if fmt == "awq":
        cfg = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
        return {**cfg, "modules_to_not_convert": list(unquantized)} if unquantized else cfg
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": desc_act,
            "sym": sym,
            "checkpoint_format": "gptq",
        }
    if fmt == "fp8":
        return {
            "quant_method": "fp8",
            "activation_scheme": "static" if static else "dynamic",
            "ignored_layers": ["lm_head", *unquantized],
        }
    acts = (
        {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
        if static
        else {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    )
    w = {"num_bits": 8, "type": "float", "strategy": weights, "dynamic": False, "symmetric": True}
    if weights == "block":
        w["block_structure"] = list(block)
        acts = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": block[1], "dynamic": True}
        acts["symmetric"] = True
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": w,
                "input_activations": acts,
            }
        },
        "ignore": ["lm_head", *unquantized],
    }


def quantize_dir(
    model: str,
    out: str,
    fmt: str = "compressed-tensors",
    weights: str = "channel",
    activations: str = "dynamic",
    input_scale: float = 0.05,
    group_size: int = 128,
    sym: bool = False,
    desc_act: bool = False,
    block: tuple[int, int] = (128, 128),
) -> None:
    """Write `model`'s checkpoint quantized as `fmt` to another directory `out` (the module's docstring)."""
    static = activations == "static"
    assert os.path.abspath(model) != os.path.abspath(out), "write the quantized checkpoint elsewhere"
    os.makedirs(out, exist_ok=True)
    for path in sorted(glob.glob(os.path.join(model, "*.safetensors"))):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if not is_linear(name):
                    tensors[name] = t
                    continue
                base = name[: -len("weight")]
                if fmt in ("awq", "gptq"):
                    for part, v in int4_tensors(t, fmt, group_size, sym, desc_act).items():
                        tensors[base + part] = v.contiguous()
                    continue
                if fmt == "fp8-block" or weights == "block":
                    tensors[name], scale = quantize_blocks(t, block)
                    tensors[base + ("weight_scale_inv" if fmt == "fp8-block" else "weight_scale")] = scale
                    continue
                q, scale = quantize(t, weights == "tensor")
                tensors[name] = q
                tensors[base + "weight_scale"] = scale.reshape(()) if weights == "tensor" and fmt == "fp8" else scale
                if static:
                    tensors[base + "input_scale"] = torch.tensor(input_scale, dtype=torch.float32)
        save_file(tensors, os.path.join(out, os.path.basename(path)), metadata={"format": "pt"})
    for path in glob.glob(os.path.join(model, "*")):
        name = os.path.basename(path)
        skip = name.endswith((".safetensors", ".index.json")) or name == "config.json"  # the index names old tensors
        if os.path.isfile(path) and not skip:
            shutil.copy(path, os.path.join(out, name))
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(
        fmt, weights, static, group_size, sym, desc_act, block, tuple(routers(config))
    )
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--format", choices=["compressed-tensors", "fp8", "fp8-block", "awq", "gptq"], default="compressed-tensors"
    )
    ap.add_argument("--group-size", type=int, default=128, help="awq/gptq: input rows a scale covers (-1: all)")
    ap.add_argument("--sym", action="store_true", help="gptq: symmetric (zero point 8)")
    ap.add_argument("--desc-act", action="store_true", help="gptq: groups over a permutation of the input rows (g_idx)")
    ap.add_argument("--weights", choices=["channel", "tensor", "block"], default="channel")
    ap.add_argument(
        "--block-size", type=int, nargs="+", default=[128, 128], help="fp8-block / --weights block: bn [bk] (bk = bn)"
    )
    ap.add_argument("--activations", choices=["dynamic", "static"], default="dynamic")
    ap.add_argument("--input-scale", type=float, default=0.05)
    args = ap.parse_args()
    if args.format == "fp8" and args.weights != "tensor":
        ap.error("--format fp8 stores per-tensor weight scales: pass --weights tensor")
    if (args.format == "fp8-block" or args.weights == "block") and args.activations != "dynamic":
        ap.error("block-wise FP8 quantizes activations dynamically (per token group): --activations dynamic")
    if args.weights == "block" and args.format != "compressed-tensors":
        ap.error("--weights block is compressed-tensors' block layout; --format fp8-block writes quant_method fp8's")
    if len(args.block_size) not in (1, 2):
        ap.error("--block-size takes bn or bn bk")
    block = (args.block_size[0], args.block_size[-1])
    quantize_dir(
        args.model,
        args.out,
        args.format,
        args.weights,
        args.activations,
        args.input_scale,
        args.group_size,
        args.sym,
        args.desc_act,
        block,
    )
    print(f"wrote {args.format} to {args.out}")


if __name__ == "__main__":
    main()
