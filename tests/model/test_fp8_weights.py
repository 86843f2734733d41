"""quantization="fp8" (vLLM's on-the-fly FP8) against an independent reference: HF transformers'
model with each decoder linear layer's weight quantized per output channel and its input per
token, written here with plain torch ops. Exactness: the same greedy tokens and logits within
float32 rounding; the weights shrink; what cannot be quantized exactly is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.errors import InvalidRequestError

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fake_fp8(x: torch.Tensor) -> torch.Tensor:
    """Each row quantized to e4m3 with scale max|row| / 448 and back (float32)."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


def fp8_reference(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in LINEARS:
            module.weight.data = fake_fp8(module.weight.data)
            module.register_forward_pre_hook(lambda _m, args: (fake_fp8(args[0]),))
    return model


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :], model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fp8_weights_match_the_quantized_reference(tiny_models, family):
    path = tiny_models[family]
    ref = fp8_reference(path)
    llm = LLM(path, dtype="float32", quantization="fp8", num_kv_blocks=64, block_size=8, enable_prefix_caching=False)
    prompts = [[5, 9, 14, 22, 31, 40, 7], [100 + i for i in range(19)]]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0),
        use_tqdm=False,
    )
    for p, out in zip(prompts, outs, strict=True):
        want, logits = reference_greedy(ref, p, 12)
        assert out.outputs[0].token_ids == want
        # prompt logprobs: the reference's log-softmax at each prompt position
        ref_lp = torch.log_softmax(logits[: len(p) - 1], dim=-1)
        got = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
        exp = [float(ref_lp[i, p[i + 1]]) for i in range(len(p) - 1)]
        assert got == pytest.approx(exp, abs=2e-4)


def test_fp8_weights_differ_from_unquantized_and_shrink(tiny_models):
    """Not a no-op: the logits move (fp8 rounding) and the linear weights take 1 byte each."""
    path = tiny_models["qwen3"]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    prompt = [{"prompt_token_ids": list(range(3, 40))}]
    plain = LLM(path, dtype="float32", num_kv_blocks=32)
    fp8 = LLM(path, dtype="float32", quantization="fp8", num_kv_blocks=32)
    a = [next(iter(d.values())).logprob for d in plain.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs[1:]]
    b = [next(iter(d.values())).logprob for d in fp8.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs[1:]]
    assert a != pytest.approx(b, abs=1e-6)
    assert fp8.runner.weights_bytes < plain.runner.weights_bytes
    linear_dtypes = {m.weight.dtype for m in fp8.runner.model.modules() if type(m).__name__.endswith("ParallelLinear")}
    assert linear_dtypes == {torch.float8_e4m3fn}


def test_unknown_quantization_is_refused_naming_the_field(tiny_models):
    with pytest.raises(InvalidRequestError) as e:
        LLM(tiny_models["qwen3"], quantization="awq", num_kv_blocks=8)
    assert e.value.param == "quantization" and "fp8" in str(e.value)
