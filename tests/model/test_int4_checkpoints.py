"""4-bit AWQ and GPTQ checkpoints (model/int4_weights.py): the packing conventions pinned against
the formats' definitions with hand-built integers, then checkpoints written by
tools/quantize_checkpoint.py against HF transformers' model with the weights those checkpoints mean,
dequantized here by plain loops (independent of pagedllm's unpacking): the same greedy tokens."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors import safe_open

from pagedllm import LLM, SamplingParams
from pagedllm.engine.errors import InvalidRequestError
from pagedllm.model.int4_weights import dequantize_gptq, unpack_awq, unpack_gptq_cols, unpack_gptq_rows
from tests.model.test_fp8_checkpoints import LINEARS, checkpoint_tensors, reference_greedy, write


def int32(nibbles: list[int]) -> int:
    v = sum(n << (4 * k) for k, n in enumerate(nibbles))
    return v - (1 << 32) if v >= 1 << 31 else v


def test_awq_packs_eight_columns_in_its_interleaved_order():
    """AWQ's gemm layout: nibble k holds output column (0, 2, 4, 6, 1, 3, 5, 7)[k] of its eight."""
    packed = torch.tensor([[int32([1, 2, 3, 4, 5, 6, 7, 8]), int32([9, 10, 11, 12, 13, 14, 15, 0])]], dtype=torch.int32)
    assert unpack_awq(packed).tolist() == [[1, 5, 2, 6, 3, 7, 4, 8, 9, 13, 10, 14, 11, 15, 12, 0]]


def test_gptq_packs_input_rows_and_stores_zeros_minus_one():
    """GPTQ: row i of qweight at bits 4 (i % 8); qzeros column j at bits 4 (j % 8), stored minus one."""
    qweight = torch.tensor([[int32([0, 1, 2, 3, 4, 5, 6, 15])]], dtype=torch.int32)  # 8 input rows, 1 output
    assert unpack_gptq_rows(qweight)[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 15]
    qzeros = torch.tensor([[int32([7, 0, 0, 0, 0, 0, 0, 0])]], dtype=torch.int32)
    assert unpack_gptq_cols(qzeros)[0, 0] == 7
    w = dequantize_gptq(qweight, qzeros[:, :1], torch.tensor([[0.5]]), None, zero_offset=1)  # zero 7 + 1 = 8
    assert w[0].tolist() == [(q - 8) * 0.5 for q in [0, 1, 2, 3, 4, 5, 6, 15]]


def test_the_tools_gptq_zeros_mean_what_was_quantized():
    """tools/quantize_checkpoint.py, GPTQ asymmetric: groups with no negative weight (a zero of 0,
    which GPTQ's original format cannot store: it stores zero - 1 in 4 bits) beside groups with
    zeros inside; read back element by element as the format defines it, every weight is within
    half a quantization step of the original."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
    from quantize_checkpoint import int4_tensors

    torch.manual_seed(0)
    w = torch.randn(16, 64)
    w[0::2] = w[0::2].abs()  # even output rows: every group non-negative
    t = int4_tensors(w, "gptq", 32, sym=False, desc_act=False)
    err = (reference_weight(t, "gptq") - w).abs()
    step = t["scales"].float().t().repeat_interleave(32, dim=1)  # [out, in]
    assert (err <= 0.5 * step + 1e-3).all()


def nib(x: int, k: int) -> int:
    return (x >> (4 * k)) & 0xF


def reference_weight(t: dict[str, torch.Tensor], method: str) -> torch.Tensor:
    """W [out, in] from a layer's packed tensors, element by element as the formats define them."""
    qw, qz, sc = t["qweight"].tolist(), t["qzeros"].tolist(), t["scales"].float()
    if method == "awq":
        rows, out = len(qw), len(qw[0]) * 8
        order = (0, 2, 4, 6, 1, 3, 5, 7)
        col = {order[k]: k for k in range(8)}  # column j % 8 sits in nibble col[j % 8]
        group = rows // sc.shape[0]
        w = torch.empty(rows, out)
        for i in range(rows):
            for j in range(out):
                q = nib(qw[i][j // 8], col[j % 8])
                z = nib(qz[i // group][j // 8], col[j % 8])
                w[i, j] = (q - z) * sc[i // group, j]
        return w.t()
    rows, out = len(qw) * 8, len(qw[0])
    g_idx = t["g_idx"].tolist()
    w = torch.empty(rows, out)
    for i in range(rows):
        for j in range(out):
            q = nib(qw[i // 8][j], i % 8)
            z = nib(qz[g_idx[i]][j // 8], j % 8) + 1
            w[i, j] = (q - z) * sc[g_idx[i], j]
    return w.t()


def reference_model(src: str, ckpt: str, method: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").float().eval()
    tensors = checkpoint_tensors(ckpt)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in LINEARS:
            parts = {
                p: tensors[f"{name}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx") if f"{name}.{p}" in tensors
            }
            module.weight.data = reference_weight(parts, method)
    return model


@pytest.mark.parametrize(
    "fmt,flags",
    [("awq", []), ("gptq", []), ("gptq", ["--sym"]), ("gptq", ["--desc-act"]), ("gptq", ["--sym", "--desc-act"])],
)
def test_int4_checkpoint_matches_the_weights_it_means(tiny_models, tmp_path, fmt, flags):
    src = tiny_models["qwen3"]
    ckpt = write(src, str(tmp_path / fmt), "--format", fmt, "--group-size", "32", *flags)
    ref = reference_model(src, ckpt, fmt)
    llm = LLM(ckpt, dtype="float32", num_kv_blocks=64, block_size=8, enable_prefix_caching=False)
    prompts = [[5, 9, 14, 22, 31, 40, 7], [100 + i for i in range(19)]]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(ref, p, 10)
    # not a no-op: the 4-bit weights differ from the original ones
    with safe_open(os.path.join(src, "model.safetensors"), framework="pt") as s:
        original = s.get_tensor("model.layers.0.self_attn.o_proj.weight").float()
    attn = llm.runner.model.model.layers[0].self_attn
    assert attn.qkv_proj.int4 is not None and attn.o_proj.int4 is not None  # packed, not dequantized at load
    assert (attn.qkv_proj.int4.perm is not None) == ("--desc-act" in flags)
    got = attn.o_proj.int4.weight()
    assert not torch.equal(got, original) and (got - original).abs().max() < 0.5 * original.abs().max()
    llm.close()


@pytest.mark.parametrize(
    "change,field",
    [
        ({"bits": 8}, "quantization_config.bits=8"),
        ({"version": "gemv"}, "quantization_config.version='gemv'"),
        ({"zero_point": False}, "quantization_config.zero_point=False"),
    ],
)
def test_awq_layouts_it_cannot_load_are_refused(tiny_models, tmp_path, change, field):
    ckpt = write(tiny_models["qwen3"], str(tmp_path / "q"), "--format", "awq", "--group-size", "32")
    path = os.path.join(ckpt, "config.json")
    cfg = json.load(open(path))
    cfg["quantization_config"].update(change)
    json.dump(cfg, open(path, "w"))
    with pytest.raises(InvalidRequestError, match=re.escape(field)):
        LLM(ckpt, num_kv_blocks=8)


def test_gptq_marlin_format_is_refused_and_quantization_must_agree(tiny_models, tmp_path):
    ckpt = write(tiny_models["qwen3"], str(tmp_path / "q"), "--format", "gptq", "--group-size", "32")
    with pytest.raises(InvalidRequestError, match="does not match") as e:
        LLM(ckpt, quantization="awq", num_kv_blocks=8)
    assert e.value.param == "quantization"
    path = os.path.join(ckpt, "config.json")
    cfg = json.load(open(path))
    cfg["quantization_config"]["checkpoint_format"] = "marlin"
    json.dump(cfg, open(path, "w"))
    with pytest.raises(InvalidRequestError, match=re.escape("quantization_config.checkpoint_format='marlin'")):
        LLM(ckpt, num_kv_blocks=8)
