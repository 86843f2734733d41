"""Gemma 2, Gemma 3 (text), Phi-3 and the windowed Mistral / Qwen2 against HF transformers in
float32: tiny random checkpoints written by HF and loaded unchanged.

What each one exercises: Gemma 2 the (1 + w) norms, the four "sandwich" norms, the scaled
embedding, GeGLU, query_pre_attn_scalar and both soft caps on alternating sliding/full layers;
Gemma 3 the q/k norms and a rope base per layer kind (linear scaling on the global layers);
Phi-3 its packed qkv_proj / gate_up_proj checkpoint tensors and a window on every layer;
Mistral a window on every layer; Qwen2 the window from max_window_layers on.

One prefill of 100 tokens past a window of 32 runs the model directly (no KV history); through
the LLM, prompts of 20-200 tokens run past the window, with the sliding-window layers in KV-cache
groups of their own (blocks that leave a window are given back) under each scheduling setting."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model.loader import load_weights
from pagedllm.model.registry import build_model, layer_windows
from pagedllm.ops.kernels import TorchKernels
from tests.helpers import TINY_SHAPE
from tests.model.families import KINDS, WINDOW, family_checkpoints, long_workload, ours, prefill_logits
from tests.model.hf_reference import GREEDY, hf_model, hf_position_logits, step_logits


@pytest.fixture(scope="module")
def family_models(tiny_models, tmp_path_factory):
    return family_checkpoints(tiny_models["qwen3"], tmp_path_factory)


@pytest.mark.parametrize("kind", KINDS)
def test_one_prefill_past_the_window_matches_hf(family_models, kind):
    """Every position of a 100-token prefill with window 32, against HF's logits; the layers'
    windows are HF's (the same model attending to everything is far off)."""
    path = family_models[kind]
    hf = hf_model(path)
    expected = {"gemma2": [WINDOW, None], "gemma3": [WINDOW, None], "qwen2": [None, WINDOW]}
    assert layer_windows(hf.config) == expected.get(kind, [WINDOW, WINDOW])
    ids = torch.randint(1, TINY_SHAPE["vocab_size"], (100,), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        want = hf(ids[None]).logits[0]
    model = ours(path)
    torch.testing.assert_close(prefill_logits(model, ids), want, rtol=1e-4, atol=1e-4)
    for attn in model.attention_layers():
        attn.sliding_window = None
    unwindowed = prefill_logits(model, ids)
    assert (unwindowed[WINDOW:] - want[WINDOW:]).abs().max() > 1e-2
    torch.testing.assert_close(unwindowed[:WINDOW], want[:WINDOW], rtol=1e-4, atol=1e-4)


def test_gemma2_soft_caps_bite(family_models):
    """Both caps change the logits: the final cap bounds them, the attention cap moves them."""
    model = ours(family_models["gemma2"])
    ids = torch.arange(1, 40)
    capped = prefill_logits(model, ids)
    assert capped.abs().max() < 3.0
    model.final_logit_soft_cap = None
    assert prefill_logits(model, ids).abs().max() > 3.0
    model.final_logit_soft_cap = 3.0
    for attn in model.attention_layers():
        attn.logits_soft_cap = None
    assert (prefill_logits(model, ids) - capped).abs().max() > 1e-2


CONFIGS = {  # the pool: 64 blocks unless set (a lone 214-token sequence needs at most 14 + 7 at block size 16)
    "chunked_prefix_bs8": dict(block_size=8, max_num_batched_tokens=40),
    "preemption_bs16": dict(block_size=16, num_kv_blocks=24, max_num_batched_tokens=64),
    "no_prefix_bs32": dict(block_size=32, enable_prefix_caching=False, max_num_batched_tokens=48),
    "async_prefix_bs16": dict(block_size=16, async_scheduling=True, max_num_batched_tokens=96),
    "sync_prefix_bs16": dict(block_size=16, async_scheduling=False, max_num_batched_tokens=256),
}


@pytest.mark.parametrize("kind", KINDS)
def test_every_step_of_a_ragged_batch_matches_hf(family_models, kind):
    """Through LLM.generate (greedy), every logits row of every step (chunked prefills and decodes
    batched together) is within 1e-4 of HF's for that context, and the token taken is HF's argmax
    there: the greedy tokens are HF's. Each family under one scheduling configuration (they take
    turns, so every configuration runs some family)."""
    path = family_models[kind]
    config = list(CONFIGS)[KINDS.index(kind) % len(CONFIGS)]
    llm = LLM(path, **{"num_kv_blocks": 64, "max_model_len": 256, **CONFIGS[config]})
    prompts, max_tokens = long_workload()
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    rows, steps = step_logits(llm, prompts, params)
    hf = {ids: hf_position_logits(path, list(ids)) for ids in {ids for _, ids, _ in rows}}
    for logits, ids, n in rows:
        want = hf[ids][n - 1]  # HF's logits after the first n tokens
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
        assert ids[n] == int(want.argmax())
    assert len(rows) == sum(max_tokens)
    assert any(len(ids) > 1 for ids in steps)
    m = llm.get_metrics()
    kinds = [(g["kind"], g["sliding_window"]) for g in m["kv_cache_groups"]]
    windowed = [("sliding_window", WINDOW)]
    assert kinds == (windowed if kind in ("phi3", "mistral") else [("full_attention", None), *windowed])
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
    if "preemption" in config:
        assert m["num_preemptions"] > 0
    if "prefix" in config and "no_prefix" not in config:
        assert m["prefix_cache_hit_tokens"] > 0


# ------------------------------------------------------------------ what is refused, naming the field


def edited(path: str, tmp_path, **changes) -> str:
    """A copy of the checkpoint whose config.json has `changes` (None: the key removed)."""
    out = tmp_path / "edited"
    shutil.copytree(path, out)
    with open(out / "config.json") as f:
        cfg = json.load(f)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    with open(out / "config.json", "w") as f:
        json.dump(cfg, f)
    return str(out)


REFUSED = {
    "hidden_activation": ("gemma2", dict(hidden_activation="gelu")),
    "hidden_act": ("phi3", dict(hidden_act="relu")),
    "partial_rotary_factor": (  # HF's Mistral rotates whole heads whatever the factor says
        "mistral",
        dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    ),
    "dynamic": ("qwen2", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})),
    "use_bidirectional_attention": ("gemma3", dict(use_bidirectional_attention=True)),
    "attention_chunk_size": ("mistral", dict(attention_chunk_size=16)),
    "layer_types": ("gemma2", dict(layer_types=["sliding_attention", "chunked_attention"])),
    "sliding_window_pattern": ("gemma3", dict(sliding_window_pattern=3)),
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_what_the_decoder_cannot_run_exactly_is_refused_at_start_up(family_models, tmp_path, field):
    kind, changes = REFUSED[field]
    with pytest.raises(ValueError, match=field):
        LLM(edited(family_models[kind], tmp_path, **changes), num_kv_blocks=8, max_model_len=WINDOW)


QUANTIZED = {
    # the issue-33 case: FP8 block-wise with static activations and no scale tensors loaded silently
    "fp8": {"quant_method": "fp8", "weight_block_size": [64, 64], "activation_scheme": "static"},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "float-quantized"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
}


# the field each refusal names: what pagedllm loads (model/quant_config.py) stops at the first field it cannot
REFUSED_FIELD = {
    "fp8": "quantization_config.activation_scheme='static'",  # block-wise weights take dynamic activations
    "compressed-tensors": "quantization_config.config_groups=[]",
    "awq": "quantization_config.quant_method='awq'",
    "gptq": "quantization_config.quant_method='gptq'",
}


@pytest.mark.parametrize("method", list(QUANTIZED))
def test_a_quantized_checkpoint_it_cannot_load_is_refused_naming_the_field(family_models, tmp_path, method):
    """A checkpoint whose quantization_config pagedllm cannot load exactly (block-wise FP8 with static
    activations, a
    compressed-tensors config without its scheme), or whose tensors disagree with its config (AWQ and
    GPTQ configs over unquantized weights), fails at start-up naming the field and value, never
    computing with the wrong weights (the layouts it loads: tests/model/test_fp8_checkpoints.py,
    tests/model/test_int4_checkpoints.py)."""
    from pagedllm.engine.errors import InvalidRequestError

    path = edited(family_models["qwen2"], tmp_path, quantization_config=QUANTIZED[method])
    with pytest.raises(InvalidRequestError, match=re.escape(REFUSED_FIELD[method])) as e:
        LLM(path, num_kv_blocks=8, max_model_len=WINDOW)
    assert e.value.param in ("model", "quantization_config")


def test_phi3_partial_rotary_matches_hf(tmp_path):
    """partial_rotary_factor 0.5: the first half of each head rotates (rope table of 8 dims)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(4)
    cfg = Phi3Config(partial_rotary_factor=0.5, pad_token_id=None, eos_token_id=None, **TINY_SHAPE)
    Phi3ForCausalLM(cfg).save_pretrained(str(tmp_path), safe_serialization=True)
    model = ours(str(tmp_path))
    assert model.model.layers[0].self_attn.rotary.cos_sin_cache.shape[-1] == 8
    ids = torch.arange(3, 43)
    with torch.inference_mode():
        want = hf_model(str(tmp_path))(ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(model, ids), want, rtol=1e-4, atol=1e-4)


def test_mistral_windows_every_layer_whatever_its_layer_types(family_models):
    """HF's Mistral ignores layer_types (its window is on every layer): so does layer_windows."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(family_models["mistral"])
    cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    assert layer_windows(cfg) == [WINDOW] * cfg.num_hidden_layers
    cfg.sliding_window = None
    assert layer_windows(cfg) == [None] * cfg.num_hidden_layers


# ------------------------------------------------------------------ Phi-3's packed checkpoint tensors


@pytest.mark.parametrize("rank", [0, 1])
def test_phi3_packed_weights_give_each_tp_rank_its_q_k_v_and_gate_up(family_models, monkeypatch, rank):
    """Built as rank `rank` of 2, the model holds that rank's heads of q, k and v and its half of
    gate and up, cut out of the checkpoint's packed qkv_proj / gate_up_proj."""
    import pagedllm.model.decoder
    import pagedllm.model.embedding
    import pagedllm.model.linear

    for module in (pagedllm.model.decoder, pagedllm.model.embedding, pagedllm.model.linear):
        monkeypatch.setattr(module, "tp_size", lambda: 2)
        if hasattr(module, "tp_rank"):
            monkeypatch.setattr(module, "tp_rank", lambda: rank)
    path = family_models["phi3"]
    hf = hf_model(path)
    model = build_model(hf.config, TorchKernels())
    load_weights(model, path)
    d, hq, hkv, inter = 16, 4, 2, TINY_SHAPE["intermediate_size"]

    def heads(w, first, n):  # rows of heads [first, first + n)
        return w[first * d : (first + n) * d]

    for ours_layer, hf_layer in zip(model.model.layers, hf.model.layers, strict=True):
        qkv = hf_layer.self_attn.qkv_proj.weight
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d])
        mine = torch.cat([heads(q, rank * hq // 2, hq // 2), heads(k, rank, 1), heads(v, rank, 1)])
        assert torch.equal(ours_layer.self_attn.qkv_proj.weight, mine)
        gate, up = hf_layer.mlp.gate_up_proj.weight.split([inter, inter])
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        assert torch.equal(ours_layer.mlp.gate_up_proj.weight, torch.cat([gate[half], up[half]]))
        o = hf_layer.self_attn.o_proj.weight
        assert torch.equal(ours_layer.self_attn.o_proj.weight, o[:, rank * hq // 2 * d : (rank + 1) * hq // 2 * d])
