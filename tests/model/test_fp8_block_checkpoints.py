"""Block-wise FP8 checkpoints (quant_method "fp8" with weight_block_size, compressed-tensors
strategy "block"; ops/fp8_block_linear.py) written by tools/quantize_checkpoint.py, against HF
transformers' float32 model with the checkpoint's weights dequantized block by block and each
linear input quantized per token and group of bk columns (tests/model/test_fp8_checkpoints.py's
reference, plain torch ops).

Tolerance: every logits row within LOGIT_ATOL of HF's on the same context. Both sides compute the
same quantized operands, so the rows differ only where float32 summation order moves an activation
across an e4m3 rounding boundary (one step of a 3-bit mantissa in one element of one group); on
these models the largest difference seen is ~1e-5, the bound leaves room for such flips. The greedy
tokens are compared too: the share identical to HF's own greedy run is reported (and must be 1 here).
The shapes that are not whole blocks, static activations with blocks and a TP split of a block are
refused naming the field."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.errors import InvalidRequestError
from pagedllm.model.loader import load_weights
from pagedllm.model.quant_config import read_quant_config
from pagedllm.model.quantization import prepare_checkpoint_fp8
from pagedllm.model.registry import build_model
from pagedllm.ops.fp8_block_linear import dequantize_blocks
from pagedllm.ops.kernels import TorchKernels
from tests.model.families import family_checkpoints
from tests.model.test_fp8_checkpoints import (
    block_dequantized,
    checkpoint_tensors,
    edit_config,
    reference,
    reference_greedy,
    write,
)

LOGIT_ATOL = 1e-3
PROMPTS = [[5, 9, 14, 22, 31, 40, 7], [100 + i for i in range(19)], [3, 3, 3]]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def block_flags(fmt: str, block: tuple[int, int]) -> list[str]:
    size = ["--block-size", str(block[0]), str(block[1])]
    return ["--format", fmt, *size] if fmt == "fp8-block" else ["--format", fmt, "--weights", "block", *size]


def run_with_logits(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens per prompt and the logits rows the engine sampled them from ([tokens, vocab] per prompt)."""
    rows: dict[int, list[torch.Tensor]] = {}
    real_sample = llm.runner.sample

    def spy(logits, inp):
        for row, sid in enumerate(inp.sample_seq_ids):
            rows.setdefault(sid, []).append(logits[row].clone())
        return real_sample(logits, inp)

    llm.runner.sample = spy
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [torch.stack(rows[sid]) for sid in sorted(rows)]


@torch.inference_mode()
def compare(src: str, ckpt: str, **llm_args) -> tuple[float, float]:
    """(largest logits difference from HF's on the engine's own contexts, share of greedy tokens
    identical to HF's greedy run)."""
    ref = reference(src, ckpt)
    llm = LLM(ckpt, dtype="float32", num_kv_blocks=64, block_size=8, enable_prefix_caching=False, **llm_args)
    tokens, rows = run_with_logits(llm, PROMPTS)  # sequence ids in the order of the prompts
    llm.close()
    worst, same, total = 0.0, 0, 0
    for prompt, got, ours in zip(PROMPTS, tokens, rows, strict=True):
        hf = ref(torch.tensor([prompt + got[:-1]])).logits[0, len(prompt) - 1 :]  # HF on the engine's context
        assert ours.shape == hf.shape
        worst = max(worst, float((ours - hf).abs().max()))
        want = reference_greedy(ref, prompt, len(got))
        same += sum(a == b for a, b in zip(got, want, strict=True))
        total += len(got)
    return worst, same / total


CASES = [  # family, tool format, [bn, bk]
    ("qwen3", "fp8-block", (16, 16)),
    ("qwen3", "fp8-block", (16, 32)),
    ("llama", "fp8-block", (32, 32)),
    ("qwen2", "compressed-tensors", (16, 32)),  # qkv biases
]


@pytest.mark.parametrize("family,fmt,block", CASES)
def test_block_checkpoint_matches_its_dequantized_reference(tiny_models, tmp_path, family, fmt, block, record_property):
    src = tiny_models[family]
    ckpt = write(src, str(tmp_path / "q"), *block_flags(fmt, block))
    worst, share = compare(src, ckpt)
    record_property("max_logit_diff", worst)
    record_property("identical_greedy_share", share)
    print(
        f"{family} {fmt} {block}: max |logits - HF| {worst:.2e}, identical greedy tokens {share:.0%}", file=sys.stderr
    )
    assert worst < LOGIT_ATOL and share == 1.0


def test_phi3_packed_checkpoint_tensors_cut_their_block_scales(tiny_models, tmp_path_factory, tmp_path):
    """Phi-3 stores qkv_proj / gate_up_proj packed: their scale rows are cut at the parts' bounds."""
    src = family_checkpoints(tiny_models["qwen3"], tmp_path_factory)["phi3"]
    ckpt = write(src, str(tmp_path / "q"), *block_flags("fp8-block", (16, 16)))
    worst, share = compare(src, ckpt)
    assert worst < LOGIT_ATOL and share == 1.0


def build_as_rank(ckpt: str, rank: int, monkeypatch):
    """The model as rank `rank` of 2 would build and load it (no process group)."""
    from transformers import AutoConfig

    import pagedllm.model.decoder
    import pagedllm.model.embedding
    import pagedllm.model.linear

    for module in (pagedllm.model.decoder, pagedllm.model.embedding, pagedllm.model.linear):
        monkeypatch.setattr(module, "tp_size", lambda: 2)
        if hasattr(module, "tp_rank"):
            monkeypatch.setattr(module, "tp_rank", lambda: rank)
    cfg = AutoConfig.from_pretrained(ckpt)
    model = build_model(cfg, TorchKernels())
    quant = read_quant_config(cfg)
    assert quant is not None
    prepare_checkpoint_fp8(model, quant, torch.device("cpu"))
    load_weights(model, ckpt, quant)
    return model


@pytest.mark.parametrize("rank", [0, 1])
def test_each_tp_rank_holds_the_blocks_of_its_shard(tiny_models, tmp_path, monkeypatch, rank):
    """Built as rank `rank` of 2: each layer's weight times its scales is that rank's slice of the
    checkpoint's dequantized weight (q, k, v heads and gate, up rows; o, down columns)."""
    block = (16, 16)
    ckpt = write(tiny_models["qwen3"], str(tmp_path / "q"), *block_flags("fp8-block", block))
    tensors = checkpoint_tensors(ckpt)
    model = build_as_rank(ckpt, rank, monkeypatch)

    def full(name: str) -> torch.Tensor:
        return block_dequantized(tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"], block)

    def half(w: torch.Tensor, dim: int) -> torch.Tensor:
        return w.chunk(2, dim)[rank]

    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        want = {
            layer.self_attn.qkv_proj: torch.cat([half(full(p + f"self_attn.{x}_proj"), 0) for x in "qkv"]),
            layer.mlp.gate_up_proj: torch.cat([half(full(p + f"mlp.{x}_proj"), 0) for x in ("gate", "up")]),
            layer.self_attn.o_proj: half(full(p + "self_attn.o_proj"), 1),
            layer.mlp.down_proj: half(full(p + "mlp.down_proj"), 1),
        }
        for m, w in want.items():
            assert m.weight_block == block
            assert torch.equal(dequantize_blocks(m.weight, m.weight_scale, block), w)


def test_tp2_equals_tp1(tiny_models, tmp_path):
    ckpt = write(tiny_models["qwen3"], str(tmp_path / "q"), *block_flags("fp8-block", (16, 16)))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(ckpt, num_kv_blocks=64, block_size=8) as llm:
        one = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(ckpt, tensor_parallel_size=2, num_kv_blocks=64, block_size=8) as llm:
        two = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert one == two


REFUSED = [  # tool format, [bn, bk], config edits, the field named, the error's param
    ("fp8-block", (48, 48), {}, "quantization_config.weight_block_size=[48, 48] does not tile layer", None),
    ("fp8-block", (64, 64), {}, "quantization_config.weight_block_size=[64, 64] does not tile layer", None),
    ("fp8-block", (16, 16), {"activation_scheme": "static"}, "quantization_config.activation_scheme='static'", None),
    ("fp8-block", (16, 16), {"weight_block_size": [16]}, "quantization_config.weight_block_size=[16]", None),
    ("fp8-block", (16, 16), {"weight_block_size": [0, 16]}, "quantization_config.weight_block_size=[0, 16]", None),
    (
        "compressed-tensors",
        (16, 16),
        {"config_groups/group_0/input_activations/strategy": "token"},
        "quantization_config.config_groups.group_0.input_activations.strategy='token'",
        None,
    ),
    (
        "compressed-tensors",
        (16, 16),
        {"config_groups/group_0/input_activations/group_size": 32},
        "quantization_config.config_groups.group_0.input_activations.group_size=32",
        None,
    ),
    (
        "compressed-tensors",
        (16, 16),
        {"config_groups/group_0/input_activations/dynamic": False},
        "quantization_config.config_groups.group_0.input_activations.dynamic=False",
        None,
    ),
]


@pytest.mark.parametrize("fmt,block,change,field,param", REFUSED)
def test_what_it_cannot_load_is_refused_naming_the_field(tiny_models, tmp_path, fmt, block, change, field, param):
    ckpt = write(tiny_models["qwen3"], str(tmp_path / "q"), *block_flags(fmt, block))
    edit_config(ckpt, **change)
    with pytest.raises(InvalidRequestError, match=re.escape(field)) as e:
        LLM(ckpt, num_kv_blocks=8)
    assert e.value.param in ("model", param or field.partition("=")[0])  # config fields: at "model" when read


def test_a_block_the_tp_split_would_cut_is_refused_naming_it(tiny_models, tmp_path, monkeypatch):
    """k and v have 32 rows (2 heads of 16): blocks of 32 rows are whole at TP=1 and cut at TP=2."""
    ckpt = write(tiny_models["qwen3"], str(tmp_path / "q"), *block_flags("fp8-block", (32, 32)))
    with pytest.raises(InvalidRequestError, match=r"tensor_parallel_size=2 splits the \[32, 32\] blocks") as e:
        build_as_rank(ckpt, 0, monkeypatch)
    assert e.value.param == "tensor_parallel_size" and "qkv_proj" in str(e.value)


def test_a_tp_split_block_fails_the_tp_start_up(tiny_models, tmp_path):
    ckpt = write(tiny_models["qwen3"], str(tmp_path / "q"), *block_flags("fp8-block", (32, 32)))
    with pytest.raises(InvalidRequestError, match=r"tensor_parallel_size=2 splits"):
        LLM(ckpt, tensor_parallel_size=2, num_kv_blocks=8)


def test_a_block_config_over_other_tensors_is_refused(tiny_models, tmp_path):
    """A block-wise config over unquantized weights, or with its scales missing, never loads."""
    ckpt = write(tiny_models["qwen3"], str(tmp_path / "q"), *block_flags("fp8-block", (16, 16)))
    for f in os.listdir(ckpt):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(ckpt, f))
    unquantized = os.path.join(tiny_models["qwen3"], "model.safetensors")
    os.symlink(unquantized, os.path.join(ckpt, "model.safetensors"))
    with pytest.raises(InvalidRequestError, match="its config and its tensors disagree") as e:
        LLM(ckpt, num_kv_blocks=8)
    assert e.value.param == "quantization_config"


def test_missing_block_scales_fail_the_load(tiny_models, tmp_path):
    from safetensors.torch import save_file

    ckpt = write(tiny_models["qwen3"], str(tmp_path / "q"), *block_flags("fp8-block", (16, 16)))
    tensors = {k: v for k, v in checkpoint_tensors(ckpt).items() if not k.endswith("o_proj.weight_scale_inv")}
    save_file(tensors, os.path.join(ckpt, "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks weights for .*o_proj\.weight_scale"):
        LLM(ckpt, num_kv_blocks=8)


def test_modules_to_not_convert_stay_in_the_model_dtype(tiny_models, tmp_path):
    """o_proj left unquantized (its original weight, no scale) and listed: it loads as it is, the rest
    block-wise; the engine's logits then match HF's with o_proj unquantized."""
    from safetensors.torch import save_file

    src = tiny_models["qwen3"]
    ckpt = write(src, str(tmp_path / "q"), *block_flags("fp8-block", (16, 16)))
    original = checkpoint_tensors(src)
    tensors = {k: v for k, v in checkpoint_tensors(ckpt).items() if not k.endswith("o_proj.weight_scale_inv")}
    tensors.update({k: v for k, v in original.items() if k.endswith("o_proj.weight")})
    save_file(tensors, os.path.join(ckpt, "model.safetensors"))
    edit_config(ckpt, modules_to_not_convert=["lm_head", "o_proj"])
    with LLM(ckpt, dtype="float32", num_kv_blocks=16, block_size=8) as llm:
        attn = llm.runner.model.model.layers[0].self_attn
        assert attn.o_proj.weight.dtype == torch.float32 and attn.o_proj.weight_block is None
        assert attn.qkv_proj.weight_block == (16, 16)
        _, rows = run_with_logits(llm, PROMPTS[:1])
    ref = reference(src, ckpt)  # o_proj: its scale is absent, so HF keeps the original weight unhooked
    with torch.no_grad():
        hf = ref(torch.tensor([PROMPTS[0]])).logits[0, -1]
    assert float((rows[0][0] - hf).abs().max()) < LOGIT_ATOL


@pytest.mark.slow  # 4 x 4.5 s on 2 cores: run after the README command (.ci/run)
@pytest.mark.parametrize("kind", ["fp8-block", "fp8-channel", "awq", "gptq"])
def test_make_random_model_writes_each_format_through_the_tool(tmp_path, kind):
    """tools/make_random_model.py --quantize: the random model quantized by quantize_checkpoint.py's
    code; it loads as that format and generates."""
    import subprocess

    out = str(tmp_path / kind)
    tool = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "make_random_model.py")
    cmd = [sys.executable, tool, "--out", out, "--shape", "tiny", "--device", "cpu", "--quantize", kind]
    subprocess.run([*cmd, "--quant-block", "32"], check=True, capture_output=True, text=True)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".unquantized")]  # the scratch copy is gone
    with LLM(out, num_kv_blocks=16, block_size=8) as llm:
        qkv = llm.runner.model.model.layers[0].self_attn.qkv_proj
        fp8 = kind.startswith("fp8")
        assert (qkv.int4 is not None) == (not fp8)  # 4-bit: packed, no `weight`
        assert not fp8 or qkv.weight.dtype == torch.float8_e4m3fn
        assert qkv.weight_block == ((32, 32) if kind == "fp8-block" else None)
        out_tokens = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        assert len(out_tokens[0].outputs[0].token_ids) == 3
