"""FP8 checkpoints (config.json's quantization_config, model/quant_config.py) written by
tools/quantize_checkpoint.py, against an independent reference: HF transformers' model with each
decoder linear weight replaced by the checkpoint's own dequantized weight and its input quantized
per token (dynamic), per token and group of bk columns (block-wise weights) or with the checkpoint's
input_scale (static), in plain torch ops. The layouts it cannot load are refused naming the field
and its value. Block-wise checkpoints: tests/model/test_fp8_block_checkpoints.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from pagedllm import LLM, SamplingParams
from pagedllm.engine.errors import InvalidRequestError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")


def write(src: str, out: str, *flags: str) -> str:
    cmd = [sys.executable, os.path.join(ROOT, "tools", "quantize_checkpoint.py"), "--model", src, "--out", out, *flags]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def per_token(x: torch.Tensor) -> torch.Tensor:
    scale = (x.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


def per_token_group(x: torch.Tensor, group: int) -> torch.Tensor:
    return per_token(x.unflatten(-1, (-1, group))).flatten(-2)


def weight_block(ckpt: str) -> tuple[int, int] | None:
    """[bn, bk] of a block-wise checkpoint (either layout), else None."""
    with open(os.path.join(ckpt, "config.json")) as f:
        q = json.load(f)["quantization_config"]
    if q.get("weight_block_size"):
        return tuple(q["weight_block_size"])
    weights = next(iter(q.get("config_groups", {}).values()), {}).get("weights", {})
    return tuple(weights["block_structure"]) if weights.get("strategy") == "block" else None


def block_dequantized(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W [N, K] = q * the scale of its block, element by element (partial last blocks too)."""
    (bn, bk), (n, k) = block, q.shape
    rows = torch.arange(n)[:, None] // bn
    cols = torch.arange(k)[None, :] // bk
    return q.float() * scale.float()[rows, cols]


def checkpoint_tensors(ckpt: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, by name."""
    tensors = {}
    for path in sorted(os.listdir(ckpt)):
        if path.endswith(".safetensors"):
            with safe_open(os.path.join(ckpt, path), framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def reference(src: str, ckpt: str):
    """HF's float32 model of the unquantized checkpoint with the FP8 checkpoint's weights, dequantized."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").float().eval()
    tensors = checkpoint_tensors(ckpt)
    block = weight_block(ckpt)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in LINEARS and block is not None:
            scale = tensors.get(f"{name}.weight_scale_inv", tensors.get(f"{name}.weight_scale"))
            if scale is None:  # a layer the checkpoint left unquantized: its original weight, unhooked
                continue
            module.weight.data = block_dequantized(tensors[f"{name}.weight"], scale, block)
            module.register_forward_pre_hook(lambda _m, args, g=block[1]: (per_token_group(args[0], g),))
        elif isinstance(module, torch.nn.Linear) and name.split(".")[-1] in LINEARS:
            scale = tensors[f"{name}.weight_scale"].float()
            scale = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())
            module.weight.data = tensors[f"{name}.weight"].float() * scale
            if f"{name}.input_scale" in tensors:
                s = tensors[f"{name}.input_scale"].float()
                module.register_forward_pre_hook(
                    lambda _m, args, s=s: ((args[0] / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s,)
                )
            else:
                module.register_forward_pre_hook(lambda _m, args: (per_token(args[0]),))
    return model


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


LAYOUTS = [
    ("compressed-tensors", "channel", "dynamic"),
    ("compressed-tensors", "tensor", "static"),
    ("fp8", "tensor", "dynamic"),
    ("fp8", "tensor", "static"),
]


@pytest.mark.parametrize("fmt,weights,acts", LAYOUTS)
def test_fp8_checkpoint_matches_its_dequantized_reference(tiny_models, tmp_path, fmt, weights, acts):
    src = tiny_models["qwen3"]
    ckpt = write(src, str(tmp_path / "fp8"), "--format", fmt, "--weights", weights, "--activations", acts)
    ref = reference(src, ckpt)
    llm = LLM(ckpt, dtype="float32", num_kv_blocks=64, block_size=8, enable_prefix_caching=False)
    linears = [m for m in llm.runner.model.modules() if type(m).__name__.endswith("ParallelLinear")]
    assert linears and {m.weight.dtype for m in linears} == {torch.float8_e4m3fn}
    prompts = [[5, 9, 14, 22, 31, 40, 7], [100 + i for i in range(19)]]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(ref, p, 10)
    llm.close()


def test_a_per_channel_checkpoint_equals_on_the_fly_fp8(tiny_models, tmp_path):
    """The checkpoint's per-channel weights are what quantization='fp8' makes at load: same tokens."""
    src = tiny_models["llama"]
    ckpt = write(src, str(tmp_path / "fp8"), "--weights", "channel")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(3, 30))}]
    a = LLM(ckpt, dtype="float32", num_kv_blocks=32).generate(prompt, params, use_tqdm=False)[0]
    b = LLM(src, dtype="float32", num_kv_blocks=32, quantization="fp8").generate(prompt, params, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def edit_config(ckpt: str, **changes) -> None:
    path = os.path.join(ckpt, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    q = cfg["quantization_config"]
    for key, value in changes.items():
        target = q
        *parents, leaf = key.split("/")
        for part in parents:
            target = target[part]
        target[leaf] = value
    with open(path, "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize(
    "fmt,change,param",
    [
        ("fp8", {"weight_block_size": [128, 128]}, "quantization_config.weight_block_size"),
        ("fp8", {"activation_scheme": "sometimes"}, "quantization_config.activation_scheme"),
        ("fp8", {"quant_method": "bitsandbytes"}, "quantization_config.quant_method"),
        ("fp8", {"quant_method": "awq"}, "quantization_config.bits"),  # an AWQ config must say its bits
        ("compressed-tensors", {"format": "pack-quantized"}, "quantization_config.format"),
        (
            "compressed-tensors",
            {"config_groups/group_0/weights/strategy": "group"},
            "quantization_config.config_groups.group_0.weights.strategy",
        ),
        (
            "compressed-tensors",
            {"config_groups/group_0/input_activations": None},
            "quantization_config.config_groups.group_0.input_activations",
        ),
        ("compressed-tensors", {"ignore": ["lm_head", "q_proj"]}, "quantization_config.ignore"),
    ],
)
def test_layouts_it_cannot_load_are_refused_naming_the_field(tiny_models, tmp_path, fmt, change, param):
    flags = ["--format", fmt, "--weights", "tensor"]
    ckpt = write(tiny_models["qwen3"], str(tmp_path / "q"), *flags)
    edit_config(ckpt, **change)
    with pytest.raises(InvalidRequestError, match=re.escape(param)) as e:  # the message names the field and value
        LLM(ckpt, num_kv_blocks=8)
    assert e.value.param in ("model", param), e.value.param


def test_the_quantization_argument_must_agree_with_the_checkpoint(tiny_models, tmp_path):
    ckpt = write(tiny_models["qwen3"], str(tmp_path / "q"))  # compressed-tensors
    with pytest.raises(InvalidRequestError, match="does not match") as e:
        LLM(ckpt, quantization="fp8", num_kv_blocks=8)
    assert e.value.param == "quantization"
    assert LLM(ckpt, quantization="compressed-tensors", num_kv_blocks=8).runner is not None
    with pytest.raises(InvalidRequestError) as e:  # an unquantized checkpoint cannot be "compressed-tensors"
        LLM(tiny_models["qwen3"], quantization="compressed-tensors", num_kv_blocks=8)
    assert e.value.param == "quantization"


def test_the_tool_keeps_the_other_files(tiny_models, tmp_path):
    ckpt = write(tiny_models["qwen3"], str(tmp_path / "q"))
    src_files = {f for f in os.listdir(tiny_models["qwen3"]) if not f.endswith((".safetensors", ".index.json"))}
    assert src_files <= set(os.listdir(ckpt))
    shutil.rmtree(ckpt)
