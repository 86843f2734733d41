"""Quantized mixture-of-experts checkpoints (experts quantized, the router not) written by
tools/quantize_checkpoint.py from tests/model/test_moe.py's Qwen3-MoE and Mixtral checkpoints, against
HF transformers' float32 model loaded with the checkpoint's weights dequantized here by plain torch ops
(dense layers: tests/model/test_fp8_checkpoints.py's and test_int4_checkpoints.py's references; experts:
every expert's gate/up/down from its own tensors), the activations of each quantized matmul quantized as
the format says (W8A8: per token, or per token and group of bk columns, before gate/up and before down).

Weight-only 4-bit: the same greedy tokens. W8A8: every greedy token HF's, and the logits rows on the same
contexts within float32 rounding (ROW_ATOL), except rows where float32 summation order moved one activation
across an e4m3 rounding boundary (one step of a 3-bit mantissa: tests/model/test_fp8_block_checkpoints.py).
A mixture of experts quantizes more activations than a dense model (x, then each expert's intermediate), so
such flips show: on Mixtral fp8-block 29 of 30 rows are within 1e-6 and one is 1.3e-3 away. So at least
ROW_SHARE of the rows within ROW_ATOL, and every row within FLIP_ATOL."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM
from pagedllm.engine.errors import InvalidRequestError
from pagedllm.model.moe_quant import Fp8FusedExperts, Int4FusedExperts
from tests.model.test_fp8_block_checkpoints import GREEDY, PROMPTS, block_flags, run_with_logits
from tests.model.test_fp8_checkpoints import (
    block_dequantized,
    checkpoint_tensors,
    per_token,
    per_token_group,
    reference,
    reference_greedy,
    weight_block,
    write,
)
from tests.model.test_int4_checkpoints import reference_model, reference_weight
from tests.model.test_moe import moe_checkpoints

# against HF for every layout on both families, and TP=2: about 80 s on 2 cores, run by .ci/run after
# the README's test command (pyproject.toml: the slow marker)
pytestmark = pytest.mark.slow

KINDS = ["qwen3moe_top2", "mixtral"]
ROW_ATOL, ROW_SHARE, FLIP_ATOL = 1e-5, 0.9, 5e-3
FP8 = {  # name -> the tool's flags
    "fp8-block": block_flags("fp8-block", (16, 32)),
    "ct-block": block_flags("compressed-tensors", (32, 32)),
    "ct-channel": ["--format", "compressed-tensors", "--weights", "channel"],
    "fp8-tensor": ["--format", "fp8", "--weights", "tensor"],
}
INT4 = {
    "awq": ["--format", "awq", "--group-size", "32"],
    "gptq": ["--format", "gptq", "--group-size", "32"],
    "gptq-sym-desc-act": ["--format", "gptq", "--group-size", "16", "--sym", "--desc-act"],
    "gptq-desc-act": ["--format", "gptq", "--group-size", "32", "--desc-act"],
}


@pytest.fixture(scope="module")
def moe_models(tiny_models, tmp_path_factory):
    return moe_checkpoints(tiny_models["qwen3"], tmp_path_factory)


def expert_names(layer: str, kind: str, e: int) -> tuple[str, str, str]:
    """The checkpoint's gate, up and down modules of expert e of `layer` (model.layers.N)."""
    if kind == "mixtral":
        return tuple(f"{layer}.block_sparse_moe.experts.{e}.{w}" for w in ("w1", "w3", "w2"))  # type: ignore[return-value]
    return tuple(f"{layer}.mlp.experts.{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj"))  # type: ignore[return-value]


def fp8_weight(tensors: dict[str, torch.Tensor], name: str, block) -> torch.Tensor:
    q = tensors[f"{name}.weight"]
    if block is not None:
        scale = tensors.get(f"{name}.weight_scale_inv", tensors.get(f"{name}.weight_scale"))
        return block_dequantized(q, scale, block)
    scale = tensors[f"{name}.weight_scale"].float()
    return q.float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))


def int4_weight(tensors: dict[str, torch.Tensor], name: str, method: str) -> torch.Tensor:
    parts = {p: tensors[f"{name}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx") if f"{name}.{p}" in tensors}
    return reference_weight(parts, method)


def quantized_experts_forward(experts, fake):
    """HF's experts loop with each matmul's input passed through `fake` (the activations' quantization)."""

    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(experts.num_experts):
            tok, pos = torch.where(top_k_index == e)
            if not len(tok):
                continue
            gate, up = F.linear(fake(hidden[tok]), experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(fake(F.silu(gate) * up), experts.down_proj[e])
            out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
        return out

    return forward


def moe_reference(src: str, ckpt: str, kind: str, method: str):
    """HF's float32 model with the checkpoint's weights, dequantized; W8A8 (method "fp8"): each quantized
    matmul's input quantized per token (and group)."""
    tensors = checkpoint_tensors(ckpt)
    model = reference(src, ckpt) if method == "fp8" else reference_model(src, ckpt, method)
    block = weight_block(ckpt)
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        for e in range(experts.num_experts):
            gate, up, down = expert_names(f"model.layers.{i}", kind, e)
            if method == "fp8":
                w = {n: fp8_weight(tensors, n, block) for n in (gate, up, down)}
            else:
                w = {n: int4_weight(tensors, n, method) for n in (gate, up, down)}
            experts.gate_up_proj.data[e] = torch.cat([w[gate], w[up]])
            experts.down_proj.data[e] = w[down]
        if method == "fp8":
            fake = per_token if block is None else (lambda x, g=block[1]: per_token_group(x, g))
            experts.forward = quantized_experts_forward(experts, fake)
    return model


@torch.inference_mode()
def compare(ref, ckpt: str, **llm_args) -> tuple[torch.Tensor, float, LLM]:
    """(each logits row's largest difference from HF's on the engine's contexts, share of greedy tokens
    identical to HF's greedy run, the engine)."""
    llm = LLM(ckpt, dtype="float32", num_kv_blocks=64, block_size=8, enable_prefix_caching=False, **llm_args)
    tokens, rows = run_with_logits(llm, PROMPTS)
    diffs, same, total = [], 0, 0
    for prompt, got, ours in zip(PROMPTS, tokens, rows, strict=True):
        hf = ref(torch.tensor([prompt + got[:-1]])).logits[0, len(prompt) - 1 :]
        diffs.append((ours - hf).abs().amax(dim=-1))
        want = reference_greedy(ref, prompt, len(got))
        same += sum(a == b for a, b in zip(got, want, strict=True))
        total += len(got)
    return torch.cat(diffs), same / total, llm


def assert_w8a8_close(diffs: torch.Tensor, share: float) -> None:
    within = float((diffs < ROW_ATOL).float().mean())
    assert share == 1.0 and within >= ROW_SHARE and float(diffs.max()) < FLIP_ATOL, (share, within, diffs.tolist())


def sparse_layers(llm: LLM):
    return [layer.mlp for layer in llm.runner.model.model.layers if hasattr(layer.mlp, "experts")]


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("kind", KINDS)
def test_fp8_moe_checkpoint_matches_its_dequantized_reference(moe_models, tmp_path, kind, fmt):
    src = moe_models[kind]
    ckpt = write(src, str(tmp_path / fmt), *FP8[fmt])
    diffs, share, llm = compare(moe_reference(src, ckpt, kind, "fp8"), ckpt)
    for moe in sparse_layers(llm):
        assert isinstance(moe.experts, Fp8FusedExperts) and moe.experts.w13_weight.dtype == torch.float8_e4m3fn
        assert moe.experts.block == weight_block(ckpt) and moe.gate.weight.dtype == torch.float32  # the router
    llm.close()
    assert_w8a8_close(diffs, share)


@pytest.mark.parametrize("fmt", list(INT4))
@pytest.mark.parametrize("kind", KINDS)
def test_int4_moe_checkpoint_greedy_equals_its_dequantized_reference(moe_models, tmp_path, kind, fmt):
    src = moe_models[kind]
    ckpt = write(src, str(tmp_path / fmt), *INT4[fmt])
    method = INT4[fmt][1]
    ref = moe_reference(src, ckpt, kind, method)
    diffs, share, llm = compare(ref, ckpt)
    for moe in sparse_layers(llm):
        assert isinstance(moe.experts, Int4FusedExperts)  # packed, not dequantized at load
        assert (moe.experts.w13_perm is not None) == ("desc-act" in fmt)
    llm.close()
    assert share == 1.0 and float(diffs.max()) < ROW_ATOL, (share, diffs.max())


def test_on_the_fly_fp8_quantizes_the_experts(moe_models):
    """quantization="fp8" on a mixture of experts: the experts per output row, like the linear layers,
    activations per token; the router stays float32. Against HF with the same weights quantized."""
    from tests.model.test_fp8_weights import fake_fp8, fp8_reference

    src = moe_models["qwen3moe_top2"]
    ref = fp8_reference(src)
    for layer in ref.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            experts.gate_up_proj.data = fake_fp8(experts.gate_up_proj.data)
            experts.down_proj.data = fake_fp8(experts.down_proj.data)
            experts.forward = quantized_experts_forward(experts, per_token)
    diffs, share, llm = compare(ref, src, quantization="fp8")
    layers = sparse_layers(llm)
    assert layers and all(isinstance(m.experts, Fp8FusedExperts) and m.experts.block is None for m in layers)
    assert {m.gate.weight.dtype for m in layers} == {torch.float32}
    llm.close()
    assert_w8a8_close(diffs, share)


TP_FLAGS = {
    "fp8-block": block_flags("fp8-block", (16, 16)),
    "gptq": ["--format", "gptq", "--group-size", "16"],
    "gptq-desc-act": ["--format", "gptq", "--group-size", "16", "--desc-act"],  # dequantized at load under TP
}


@pytest.mark.parametrize("fmt", list(TP_FLAGS))
def test_tp2_equals_tp1(moe_models, tmp_path, fmt):
    """Each rank holds its slice of every expert's rows (gate/up) and columns (down), scales cut with them."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for flags in [TP_FLAGS[fmt]]:
        ckpt = write(moe_models["qwen3moe_top2"], str(tmp_path / flags[1]), *flags)
        with LLM(ckpt, num_kv_blocks=64, block_size=8) as llm:
            one = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        with LLM(ckpt, tensor_parallel_size=2, num_kv_blocks=64, block_size=8) as llm:
            two = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert one == two, flags


def test_a_4bit_group_the_tp_slice_would_cut_is_refused(monkeypatch):
    """Experts of intermediate 96 in groups of 32 at TP=2: each rank would hold 48 rows, a group and a half
    (Qwen3-30B-A3B's 768 in groups of 128 at TP=4 likewise). One group over all 96 rows is exact on each
    rank's half (its scale is the whole group's); GPTQ's desc_act at TP=2 stays dequantized (None)."""
    import pagedllm.model.moe
    import pagedllm.model.quant_experts
    from pagedllm.model.moe import FusedExperts
    from pagedllm.model.quant_config import CheckpointQuant
    from pagedllm.model.quant_experts import experts_int4_groups

    for module in (pagedllm.model.moe, pagedllm.model.quant_experts):
        monkeypatch.setattr(module, "tp_size", lambda: 2)
    monkeypatch.setattr(pagedllm.model.moe, "tp_rank", lambda: 1)
    moe = type("Moe", (), {"experts": FusedExperts(4, 64, 96, "moe_intermediate_size")})()
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size=2 splits the 4-bit groups") as e:
        experts_int4_groups("model.layers.0.mlp", moe, CheckpointQuant("gptq", int4=True, group_size=32))
    assert e.value.param == "tensor_parallel_size" and "48 of their 96" in str(e.value)
    assert experts_int4_groups("l", moe, CheckpointQuant("gptq", int4=True, group_size=-1)) == (64, 48)
    assert experts_int4_groups("l", moe, CheckpointQuant("gptq", int4=True, group_size=16)) == (16, 16)
    assert experts_int4_groups("l", moe, CheckpointQuant("gptq", int4=True, group_size=16, desc_act=True)) is None


REFUSED = [  # the tool's flags, LLM arguments, the message, the error's param
    (
        block_flags("fp8-block", (32, 32)),
        dict(tensor_parallel_size=2),
        r"tensor_parallel_size=2 splits the \[32, 32\] blocks",
        "tensor_parallel_size",
    ),
    (
        ["--format", "fp8", "--weights", "tensor", "--activations", "static"],
        {},
        "quantization_config.activation_scheme: static activation scales are not supported",
        "quantization_config.activation_scheme",
    ),
    (
        block_flags("fp8-block", (64, 64)),
        {},
        re.escape("quantization_config.weight_block_size=[64, 64] does not tile"),
        "quantization_config.weight_block_size",
    ),
]


@pytest.mark.parametrize("flags,args,message,param", REFUSED)
def test_what_cannot_load_exactly_fails_at_start_up_naming_it(moe_models, tmp_path, flags, args, message, param):
    ckpt = write(moe_models["qwen3moe_top2"], str(tmp_path / "q"), *flags)
    with pytest.raises(InvalidRequestError, match=message) as e:
        LLM(ckpt, num_kv_blocks=8, block_size=8, **args)
    assert e.value.param == param


@pytest.mark.parametrize("shape", ["tiny-moe", "tiny-mixtral"])
@pytest.mark.parametrize("kind", ["fp8-block", "fp8-channel", "awq", "gptq"])
def test_make_random_model_writes_quantized_moe_checkpoints(tmp_path, shape, kind):
    """tools/make_random_model.py --quantize on the tiny MoE shapes: experts quantized, the router not."""
    import os
    import subprocess
    import sys

    from tests.model.test_fp8_checkpoints import ROOT

    out = str(tmp_path / kind)
    tool = os.path.join(ROOT, "tools", "make_random_model.py")
    cmd = [sys.executable, tool, "--out", out, "--shape", shape, "--device", "cpu", "--quantize", kind]
    subprocess.run([*cmd, "--quant-block", "32"], check=True, capture_output=True, text=True)
    tensors = checkpoint_tensors(out)
    assert not [n for n in tensors if ".gate." in n and not n.endswith(".gate.weight")]  # the router unquantized
    with LLM(out, num_kv_blocks=16, block_size=8) as llm:
        experts = sparse_layers(llm)[0].experts
        assert isinstance(experts, Fp8FusedExperts if kind.startswith("fp8") else Int4FusedExperts)
        got = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert len(got) == GREEDY.max_tokens


def test_a_quantized_router_is_refused_naming_the_config(moe_models, tmp_path):
    """The router stays in the model's dtype: a checkpoint whose router is FP8 (not in its ignore list)
    fails at start-up naming quantization_config, never loads its e4m3 bytes unscaled."""
    import json
    import os

    from safetensors.torch import save_file

    ckpt = write(moe_models["qwen3moe_top2"], str(tmp_path / "q"), *FP8["ct-channel"])
    tensors = checkpoint_tensors(ckpt)
    w = tensors["model.layers.0.mlp.gate.weight"].float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    tensors["model.layers.0.mlp.gate.weight"] = (w / scale).to(torch.float8_e4m3fn)
    tensors["model.layers.0.mlp.gate.weight_scale"] = scale
    save_file(tensors, os.path.join(ckpt, "model.safetensors"))
    path = os.path.join(ckpt, "config.json")
    cfg = json.load(open(path))
    cfg["quantization_config"]["ignore"] = ["lm_head"]
    json.dump(cfg, open(path, "w"))
    with pytest.raises(InvalidRequestError, match=r"mlp\.gate\.weight_scale.*the router") as e:
        LLM(ckpt, num_kv_blocks=8, block_size=8)
    assert e.value.param == "quantization_config"
