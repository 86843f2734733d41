"""Write an FP8 checkpoint of an unquantized Hugging Face model directory, in the layouts pagedllm
loads (model/quant_config.py): the test checkpoints, and a way to make one without other tools.

Every decoder linear weight (q/k/v/o, gate/up/down, and Phi-3's packed qkv_proj / gate_up_proj)
becomes e4m3 with scale = max|W| / 448 per output channel (`--weights channel`) or per tensor
(`--weights tensor`), W_q = saturate(W / scale), stored beside it as `weight_scale`; embeddings, norms
and the LM head stay as they are (listed in the config's ignore list). `--activations dynamic`
quantizes activations per token at run time; `static` stores one `input_scale` per layer, the
constant `--input-scale` (no calibration run: a test value, not a tuned one).

    python tools/quantize_checkpoint.py --model DIR --out DIR [--format compressed-tensors|fp8]
        [--weights channel|tensor] [--activations dynamic|static] [--input-scale 0.05]

`--format fp8` writes HF transformers' / vLLM's `quant_method: "fp8"` layout, which has per-tensor
weight scales only.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
FP8 = torch.float8_e4m3fn


def quantize(w: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale [N, 1] per channel or [1] per tensor)."""
    wf = w.float()
    amax = wf.abs().amax() if per_tensor else wf.abs().amax(dim=1, keepdim=True)
    scale = (amax / 448.0).clamp(min=1e-12)
    q = (wf / scale).clamp(-448.0, 448.0).to(FP8)
    return q.contiguous(), scale.reshape(1) if per_tensor else scale


def is_linear(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEARS and ".layers." in name


def quantization_config(fmt: str, per_tensor: bool, static: bool) -> dict:
    if fmt == "fp8":
        return {
            "quant_method": "fp8",
            "activation_scheme": "static" if static else "dynamic",
            "ignored_layers": ["lm_head"],
        }
    acts = (
        {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
        if static
        else {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    )
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "tensor" if per_tensor else "channel",
                    "dynamic": False,
                    "symmetric": True,
                },
                "input_activations": acts,
            }
        },
        "ignore": ["lm_head"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--format", choices=["compressed-tensors", "fp8"], default="compressed-tensors")
    ap.add_argument("--weights", choices=["channel", "tensor"], default="channel")
    ap.add_argument("--activations", choices=["dynamic", "static"], default="dynamic")
    ap.add_argument("--input-scale", type=float, default=0.05)
    args = ap.parse_args()
    if args.format == "fp8" and args.weights != "tensor":
        ap.error("--format fp8 stores per-tensor weight scales: pass --weights tensor")
    per_tensor, static = args.weights == "tensor", args.activations == "static"
    os.makedirs(args.out, exist_ok=True)
    for path in sorted(glob.glob(os.path.join(args.model, "*.safetensors"))):
        out: dict[str, torch.Tensor] = {}
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if not is_linear(name):
                    out[name] = t
                    continue
                q, scale = quantize(t, per_tensor)
                base = name[: -len("weight")]
                out[name] = q
                out[base + "weight_scale"] = scale.reshape(()) if per_tensor and args.format == "fp8" else scale
                if static:
                    out[base + "input_scale"] = torch.tensor(args.input_scale, dtype=torch.float32)
        save_file(out, os.path.join(args.out, os.path.basename(path)), metadata={"format": "pt"})
    for path in glob.glob(os.path.join(args.model, "*")):
        name = os.path.basename(path)
        skip = name.endswith((".safetensors", ".index.json")) or name == "config.json"  # the index names old tensors
        if os.path.isfile(path) and not skip:
            shutil.copy(path, os.path.join(args.out, name))
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(args.format, per_tensor, static)
    with open(os.path.join(args.out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    print(f"wrote {args.format} ({args.weights} weights, {args.activations} activations) to {args.out}")


if __name__ == "__main__":
    main()
