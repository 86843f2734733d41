"""The rope scalings (linear, llama3, yarn, longrope) give HF transformers' cos and sin bit for bit,
and a tiny model carrying yarn or longrope gives HF's logits; dynamic NTK and unknown types are
refused at construction, naming the type."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model.rotary import RotaryEmbedding
from pagedllm.ops.kernels import TorchKernels
from tests.helpers import TINY_SHAPE

HEAD_DIM = 16  # TINY_SHAPE: hidden 64 over 4 heads
ORIGINAL = 16  # original_max_position_embeddings of the scaled configs
YARN_ORIGINAL = 2048  # yarn's: long enough that its ramp covers a few dims (at 16 every dim is interpolated)
MAX_POS = 64
SHORT = [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)]
LONG = [2.0 + 0.7 * i for i in range(HEAD_DIM // 2)]


def yarn(**extra):
    return {"rope_type": "yarn", "factor": 5.0, "original_max_position_embeddings": YARN_ORIGINAL, **extra}


def longrope(n=HEAD_DIM // 2, **extra):
    return {"rope_type": "longrope", "short_factor": SHORT[:n], "long_factor": LONG[:n], **extra}


def hf_config(family: str, rope: dict, **extra):
    from transformers import LlamaConfig, Phi3Config, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "phi3": Phi3Config}[family]
    kw = dict(TINY_SHAPE, max_position_embeddings=MAX_POS, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kw.update(extra)
    if family == "phi3":
        kw["original_max_position_embeddings"] = ORIGINAL
    return cls(rope_scaling=dict(rope), **kw)


def hf_cos_sin(cfg, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    cls = Phi3RotaryEmbedding if cfg.model_type == "phi3" else LlamaRotaryEmbedding
    pos = torch.arange(n_pos)[None]
    cos, sin = cls(cfg)(torch.zeros(1, dtype=torch.float32), pos)
    return cos[0], sin[0]


def ours(cfg, max_model_len=None) -> RotaryEmbedding:
    rope = cfg.rope_parameters
    return RotaryEmbedding(
        HEAD_DIM, cfg.max_position_embeddings, rope["rope_theta"], rope, TorchKernels(), max_model_len=max_model_len
    )


# (family, rope parameters, positions HF sees in one forward, our max_model_len)
CASES = {
    "linear": ("llama", {"rope_type": "linear", "factor": 2.5}, MAX_POS, None),
    "llama3": (
        "llama",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
        MAX_POS,
        None,
    ),
    "yarn": ("qwen2", yarn(), MAX_POS, None),
    "yarn_attention_factor": ("qwen2", yarn(attention_factor=0.8), MAX_POS, None),
    "yarn_mscale": ("llama", yarn(mscale=0.707, mscale_all_dim=1.0), MAX_POS, None),
    "yarn_mscale_only": ("llama", yarn(mscale=0.707), MAX_POS, None),  # needs both: factor alone counts
    "yarn_no_truncate_betas": ("llama", yarn(truncate=False, beta_fast=16, beta_slow=2), MAX_POS, None),
    "yarn_factor_from_lengths": ("llama", yarn(factor=None, original_max_position_embeddings=ORIGINAL), MAX_POS, None),
    "yarn_theta_1e6": ("qwen2", yarn(rope_theta=1e6), MAX_POS, None),
    # longrope: within the original length with max_model_len <= original -> short factors
    "longrope_phi3_short": ("phi3", longrope(), ORIGINAL, ORIGINAL),
    # one forward past the original length, and max_model_len past it -> long factors
    "longrope_phi3_long": ("phi3", longrope(), MAX_POS, None),
    "longrope_phi3_long_mml": ("phi3", longrope(), ORIGINAL + 9, ORIGINAL + 9),
    "longrope_phi3_partial": ("phi3", longrope(n=HEAD_DIM // 4), MAX_POS, None, {"partial_rotary_factor": 0.5}),
    "longrope_llama_factors": (
        "llama",
        longrope(factor=3.0, attention_factor=1.25, original_max_position_embeddings=ORIGINAL),
        ORIGINAL,
        ORIGINAL - 3,
    ),
    "longrope_llama_long": ("llama", longrope(original_max_position_embeddings=ORIGINAL), 40, 40),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cos_sin_equal_hf(name):
    family, rope, n_pos, max_model_len, *extra = CASES[name]
    cfg = hf_config(family, rope, **(extra[0] if extra else {}))
    cos, sin = hf_cos_sin(cfg, n_pos)
    cache = ours(cfg, max_model_len).cos_sin_cache[:n_pos]
    half = cache.shape[-1] // 2
    assert cos.shape[-1] == 2 * half  # the rotary dim (partial: the first dims of each head)
    for got, want in ((cache[:, :half], cos), (cache[:, half:], sin)):
        assert torch.equal(got, want[:, :half]) and torch.equal(got, want[:, half:]), name


def test_longrope_factors_follow_max_model_len():
    """The same table rows differ by regime: short factors iff max_model_len <= original."""
    cfg = hf_config("phi3", longrope())
    short, long = ours(cfg, ORIGINAL).cos_sin_cache, ours(cfg, ORIGINAL + 1).cos_sin_cache
    assert torch.equal(short, ours(cfg, 3).cos_sin_cache) and torch.equal(long, ours(cfg).cos_sin_cache)
    assert not torch.allclose(short[1:ORIGINAL], long[1:ORIGINAL], atol=1e-3)


@pytest.mark.parametrize(
    "rope, match",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, r"rope_scaling rope_type 'dynamic'"),
        ({"type": "dynamic", "factor": 2.0}, r"rope_scaling rope_type 'dynamic'"),
        ({"rope_type": "proportional"}, r"'proportional' is not supported \(supported: default, .*yarn, longrope\)"),
        ({"rope_type": "su", "short_factor": SHORT, "long_factor": LONG}, r"'su' is not supported"),
    ],
)
def test_unexact_rope_types_are_refused_naming_them(rope, match):
    with pytest.raises(ValueError, match=match):
        RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0, rope, TorchKernels())


def test_longrope_factor_lists_must_fit_the_rotary_dim():
    with pytest.raises(ValueError, match="long_factor has 4 entries; the rotary dim 16 needs 8"):
        RotaryEmbedding(
            HEAD_DIM, MAX_POS, 1e4, longrope(n=4, original_max_position_embeddings=ORIGINAL), TorchKernels()
        )


# --- end to end: a tiny random model's logits against HF's, float32 -------------------------


def save_model(cfg, out: str, seed: int) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # rope matters more with sharp attention
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj]:
                proj.weight.mul_(3.0)
    model.save_pretrained(out, safe_serialization=True)
    return out


def prompt_logits(path: str, prompt: list[int], **llm_kwargs) -> torch.Tensor:
    """pagedllm's logits after the whole prompt (one forward: the prompt fits one step)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(path, num_kv_blocks=16, block_size=8, **llm_kwargs)
    captured = []
    real_sample = llm.runner.sample

    def spy(logits, inp):
        captured.append(logits.clone())
        return real_sample(logits, inp)

    llm.runner.sample = spy
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False)
    return captured[0][0]


PROMPT = [(11 * j + 5) % 300 + 1 for j in range(40)]  # past the original length of 16

E2E = {
    "qwen2_yarn": ("qwen2", yarn(), PROMPT, {}),
    "qwen2_yarn_mscale": ("qwen2", yarn(mscale=1.0, mscale_all_dim=0.5, truncate=False), PROMPT, {}),
    # max_model_len 64 > 16 and the prompt (one forward) past 16: both take the long factors
    "llama_longrope_long": ("llama", longrope(original_max_position_embeddings=ORIGINAL), PROMPT, {}),
    # max_position == original: both take the short factors (attention factor given)
    "llama_longrope_short": (
        "llama",
        longrope(original_max_position_embeddings=ORIGINAL, attention_factor=1.2),
        PROMPT[:12],
        {"max_position_embeddings": ORIGINAL},
    ),
}


@pytest.mark.parametrize("name", list(E2E))
def test_prompt_logits_equal_hf(name, tmp_path):
    from tests.model.hf_reference import hf_logits

    family, rope, prompt, extra = E2E[name]
    path = save_model(hf_config(family, rope, **extra), str(tmp_path / name), seed=len(name))
    torch.testing.assert_close(prompt_logits(path, prompt), hf_logits(path, prompt), rtol=1e-4, atol=1e-4)


def test_longrope_short_regime_through_max_model_len(tmp_path):
    """max_position 64 > original 16, but max_model_len 16: the short factors, as HF for short sequences."""
    from tests.model.hf_reference import hf_logits

    path = save_model(hf_config("llama", longrope(original_max_position_embeddings=ORIGINAL)), str(tmp_path), seed=7)
    prompt = PROMPT[:12]
    got = prompt_logits(path, prompt, max_model_len=ORIGINAL)
    torch.testing.assert_close(got, hf_logits(path, prompt), rtol=1e-4, atol=1e-4)


PHI3 = {
    "long": (longrope(), PROMPT, {}),
    "short": (longrope(attention_factor=1.2), PROMPT[:12], {"max_position_embeddings": ORIGINAL}),
}


@pytest.mark.parametrize("regime", list(PHI3))
def test_phi3_longrope_logits_equal_hf(regime, tmp_path):
    """Phi3 itself, once the registry builds Phi3ForCausalLM (its packed qkv and gate_up)."""
    from pagedllm.model.registry import SUPPORTED_ARCHITECTURES
    from tests.model.hf_reference import hf_logits

    if "Phi3ForCausalLM" not in SUPPORTED_ARCHITECTURES:
        pytest.skip("Phi3ForCausalLM is not in the registry on this branch")
    rope, prompt, extra = PHI3[regime]
    path = save_model(hf_config("phi3", rope, **extra), str(tmp_path), seed=9)
    torch.testing.assert_close(prompt_logits(path, prompt), hf_logits(path, prompt), rtol=1e-4, atol=1e-4)
