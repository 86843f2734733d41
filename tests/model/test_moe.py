"""Qwen3-MoE and Mixtral against HF transformers in float32: tiny random checkpoints written by HF's
save_pretrained (per-expert tensor names) and loaded unchanged.

Qwen3-MoE twice: 8 experts top-2 without norm_topk_prob, layer 1 dense through mlp_only_layers; 8
experts top-4 with norm_topk_prob, layer 0 dense through decoder_sparse_step=2. Mixtral: 8 experts
top-2 (renormalised). Router weights are drawn wide so that the top-k choice is far from ties."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from tests.helpers import TINY_SHAPE
from tests.model.families import long_workload, write_checkpoints
from tests.model.hf_reference import GREEDY, hf_model, hf_position_logits, step_logits
from tests.model.test_families import CONFIGS, edited, ours, prefill_logits

MOE_KINDS = ["qwen3moe_top2", "qwen3moe_top4", "mixtral"]


def hf_moe_checkpoint(kind: str, out: str) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(TINY_SHAPE, max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(MOE_KINDS.index(kind) + 21)
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **common))
    else:
        top4 = kind == "qwen3moe_top4"
        cfg = Qwen3MoeConfig(
            **dict(common, num_hidden_layers=2 if top4 else 3),
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=4 if top4 else 2,
            norm_topk_prob=top4,
            decoder_sparse_step=2 if top4 else 1,
            mlp_only_layers=[] if top4 else [1],
        )
        model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
            elif name.endswith("gate.weight"):  # the router: well-separated top-k
                p.normal_(0, 1.0)
            elif "experts" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(out, safe_serialization=True)


def moe_checkpoints(tok_dir: str, tmp_path_factory) -> dict[str, str]:
    """kind -> a checkpoint directory (with the tokenizer of tok_dir), written once per session."""
    return write_checkpoints(MOE_KINDS, hf_moe_checkpoint, tok_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def moe_models(tiny_models, tmp_path_factory):
    return moe_checkpoints(tiny_models["qwen3"], tmp_path_factory)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_prefill_matches_hf_and_the_layers_are_hfs(moe_models, kind):
    """Every position of a 60-token prefill against HF's logits; the dense and sparse layers are
    where HF has them."""
    from pagedllm.model.moe import SparseMoeBlock

    path = moe_models[kind]
    model = ours(path)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == {"qwen3moe_top2": [True, False, True], "qwen3moe_top4": [False, True]}.get(kind, [True, True])
    ids = torch.randint(1, TINY_SHAPE["vocab_size"], (60,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want = hf_model(path)(ids[None]).logits[0]
    got = prefill_logits(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_packed_expert_tensors_load_as_per_expert_ones(moe_models, tmp_path):
    """A checkpoint holding the experts packed (HF 5's in-memory gate_up_proj [E, 2I, H] and
    down_proj [E, H, I]) and Mixtral's router under block_sparse_moe gives the same logits."""
    src = moe_models["mixtral"]
    out = tmp_path / "packed"
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    for layer in range(TINY_SHAPE["num_hidden_layers"]):
        p = f"model.layers.{layer}.block_sparse_moe."
        e = [tensors.pop(f"{p}experts.{i}.{w}.weight") for i in range(8) for w in ("w1", "w3", "w2")]
        w1, w3, w2 = e[0::3], e[1::3], e[2::3]
        tensors[f"{p}experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(w1, w3, strict=True)])
        tensors[f"{p}experts.down_proj"] = torch.stack(w2)
    save_file(tensors, str(out / "model.safetensors"))
    ids = torch.arange(5, 40)
    torch.testing.assert_close(prefill_logits(ours(str(out)), ids), prefill_logits(ours(src), ids))


def test_a_missing_expert_is_named(moe_models, tmp_path):
    out = tmp_path / "missing"
    shutil.copytree(moe_models["mixtral"], out)
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.w13_weight \(1 expert matrices\)"):
        ours(str(out))


# each kind under two scheduling configurations; together they cover every configuration
SCHEDULES = [
    ("qwen3moe_top2", "chunked_prefix_bs8"),
    ("qwen3moe_top2", "async_prefix_bs16"),
    ("qwen3moe_top4", "preemption_bs16"),
    ("qwen3moe_top4", "sync_prefix_bs16"),
    ("mixtral", "no_prefix_bs32"),
    ("mixtral", "preemption_bs16"),
]


@pytest.mark.parametrize(("kind", "config"), SCHEDULES)
def test_every_step_of_a_ragged_batch_matches_hf(moe_models, kind, config):
    """Through LLM.generate (greedy), every logits row of every step (chunked prefills and decodes
    batched together) is within 1e-4 of HF's for that context and the token taken is HF's argmax.
    Full attention on every layer: the preempting pool is 15 blocks (the longest sequence needs 14)."""
    path = moe_models[kind]
    settings = dict(CONFIGS[config], num_kv_blocks=15) if "preemption" in config else CONFIGS[config]
    llm = LLM(path, **{"num_kv_blocks": 64, "max_model_len": 256, **settings})
    prompts, max_tokens = long_workload()
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    rows, steps = step_logits(llm, prompts, params)
    hf = {ids: hf_position_logits(path, list(ids)) for ids in {ids for _, ids, _ in rows}}
    for logits, ids, n in rows:
        want = hf[ids][n - 1]
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
        assert ids[n] == int(want.argmax())
    assert len(rows) == sum(max_tokens)
    assert any(len(ids) > 1 for ids in steps)
    m = llm.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
    if "preemption" in config:
        assert m["num_preemptions"] > 0
    if "prefix" in config and "no_prefix" not in config:
        assert m["prefix_cache_hit_tokens"] > 0


REFUSED = {
    "n_group": ("qwen3moe_top2", dict(n_group=4, topk_group=2)),
    "shared_expert_intermediate_size": ("qwen3moe_top2", dict(shared_expert_intermediate_size=64)),
    "scoring_func": ("mixtral", dict(scoring_func="sigmoid")),
    "hidden_act": ("mixtral", dict(hidden_act="gelu_pytorch_tanh")),
    "num_experts_per_tok": ("qwen3moe_top4", dict(num_experts_per_tok=9)),
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_unsupported_routing_is_refused_at_start_up(moe_models, tmp_path, field):
    kind, changes = REFUSED[field]
    with pytest.raises(ValueError, match=field):
        LLM(edited(moe_models[kind], tmp_path, **changes), num_kv_blocks=8, max_model_len=64)


def test_router_jitter_noise_is_accepted(moe_models, tmp_path):
    """HF's Mixtral applies router_jitter_noise in training only: the eval logits are unchanged."""
    path = edited(moe_models["mixtral"], tmp_path, router_jitter_noise=0.1)
    ids = torch.arange(3, 30)
    with torch.inference_mode():
        want = hf_model(path)(ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(ours(path), ids), want, rtol=1e-4, atol=1e-4)


def test_dummy_load_format_needs_no_weights(moe_models, tmp_path):
    """load_format="dummy": a directory with config.json and the tokenizer only; the random weights
    come from the seed (same seed, same tokens), the norms keep their unit scale."""
    out = tmp_path / "no_weights"
    shutil.copytree(moe_models["qwen3moe_top2"], out)
    os.remove(out / "model.safetensors")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(out), num_kv_blocks=8, max_model_len=64)
    params = SamplingParams(max_tokens=6, **GREEDY)
    runs = []
    for seed in (0, 0, 1):
        llm = LLM(str(out), load_format="dummy", seed=seed, num_kv_blocks=8, max_model_len=64)
        runs.append(llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids)
        norm = llm.runner.model.model.norm.weight
        assert bool((norm == 1).all())
    assert runs[0] == runs[1] and len(runs[0]) == 6
    assert llm.runner.model.model.layers[0].mlp.experts.w13_weight.std() > 0.01
