"""FP8 checkpoints written by tools/quantize_checkpoint.py, read by HF transformers' own FP8 loader
(its FineGrainedFP8 quantizer, `quant_method: "fp8"`; without a GPU it dequantizes the weights at
load): an interpretation of the checkpoint (tensor names, which way the block scales run,
`weight_scale_inv` as a multiplier) written by others than pagedllm, beside the plain-torch
reference of tests/model/test_fp8_checkpoints.py.

- HF's dequantized weights equal the checkpoint's bytes times their block's scale, as pagedllm
  reads them (the engine's own CPU linears dequantize the same way, ops/fp8_block_linear.py).
- The engine's logits against HF's FP8-loaded model on the engine's own contexts, with each of
  HF's quantized linears' inputs quantized per token and group of bk columns (the format's dynamic
  activations; HF's dequantizing path on CPU computes weight-only, which on these random models
  moves the logits by 8-10% of their norm and half the greedy tokens): within LOGIT_ATOL, and
  the same greedy tokens as HF's own greedy run.

Block-wise only: transformers 5.25 loads a per-tensor `quant_method: "fp8"` checkpoint's e4m3
bytes as the weights and calls its `weight_scale` tensors unexpected (docs/models.md)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from tests.model.test_fp8_block_checkpoints import PROMPTS, run_with_logits
from tests.model.test_fp8_checkpoints import (
    block_dequantized,
    checkpoint_tensors,
    per_token_group,
    reference_greedy,
    write,
)

pytest.importorskip("accelerate")  # transformers' FP8 loader needs it

BLOCKS = [(16, 16), (16, 32), (32, 16)]
LOGIT_ATOL = 1e-3


def hf_fp8(ckpt: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_hf_dequantizes_the_checkpoint_as_pagedllm_reads_it(tiny_models, tmp_path, block):
    ckpt = write(tiny_models["qwen3"], str(tmp_path / "q"), "--format", "fp8-block", "--block-size", *map(str, block))
    tensors = checkpoint_tensors(ckpt)
    hf = dict(hf_fp8(ckpt).named_parameters())
    quantized = [n[: -len(".weight_scale_inv")] for n in tensors if n.endswith(".weight_scale_inv")]
    assert len(quantized) >= 7  # q, k, v, o, gate, up, down of every layer
    for name in quantized:
        ours = block_dequantized(tensors[name + ".weight"], tensors[name + ".weight_scale_inv"], block)
        assert torch.equal(hf[name + ".weight"].float(), ours), name


@pytest.mark.parametrize("block", BLOCKS[:2], ids=str)
@torch.inference_mode()
def test_the_engine_against_hf_fp8_loaded_model(tiny_models, tmp_path, block):
    ckpt = write(tiny_models["qwen3"], str(tmp_path / "q"), "--format", "fp8-block", "--block-size", *map(str, block))
    hf = hf_fp8(ckpt)
    quantized = {n[: -len(".weight_scale_inv")] for n in checkpoint_tensors(ckpt) if n.endswith(".weight_scale_inv")}
    for name, module in hf.named_modules():
        if name in quantized:  # the input quantized as the engine does: per token, groups of bk columns
            module.register_forward_pre_hook(lambda m, args: (per_token_group(args[0], block[1]),))
    llm = LLM(ckpt, dtype="float32", num_kv_blocks=64, block_size=8, enable_prefix_caching=False)
    tokens, rows = run_with_logits(llm, PROMPTS)
    llm.close()
    worst, same, total = 0.0, 0, 0
    for prompt, got, ours in zip(PROMPTS, tokens, rows, strict=True):
        theirs = hf(torch.tensor([prompt + got[:-1]])).logits[0, len(prompt) - 1 :]
        worst = max(worst, float((ours - theirs).abs().max()))
        want = reference_greedy(hf, prompt, len(got))
        same += sum(a == b for a, b in zip(got, want, strict=True))
        total += len(got)
    print(f"block {block}: largest logits difference {worst:.2e}, greedy tokens identical {same}/{total}")
    assert worst < LOGIT_ATOL
    assert same == total
