"""Tiny random checkpoints of the families with windows, soft caps or packed tensors, written by
HF transformers (float32) and loaded unchanged: Gemma 2 (soft caps small enough to bite),
Gemma 3 text (a rope base per layer kind, linear scaling on the global layers), Phi-3 (packed
qkv_proj / gate_up_proj), Mistral (a window on every layer), Qwen2 (the window from
max_window_layers on). Every one has sliding_window WINDOW; norm weights are perturbed so that
each norm's form matters. Written once per session (family_checkpoints)."""

from __future__ import annotations

import os
import shutil

import torch

from pagedllm.model.decoder import DecoderForCausalLM
from pagedllm.model.loader import load_weights
from pagedllm.model.registry import build_model
from pagedllm.ops.attention_metadata import AttentionMetadata
from pagedllm.ops.kernels import TorchKernels
from tests.helpers import TINY_SHAPE

WINDOW = 32
KINDS = ["gemma2", "gemma3", "phi3", "mistral", "qwen2"]


def hf_checkpoint(kind: str, out: str) -> None:
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(TINY_SHAPE, max_position_embeddings=256, bos_token_id=None, sliding_window=WINDOW)
    gemma = dict(common, head_dim=32, query_pre_attn_scalar=24, pad_token_id=None, eos_token_id=None)
    torch.manual_seed(KINDS.index(kind) + 11)
    if kind == "gemma2":  # caps small enough to bite on these weights
        model = Gemma2ForCausalLM(Gemma2Config(attn_logit_softcapping=2.0, final_logit_softcapping=3.0, **gemma))
    elif kind == "gemma3":
        cfg = Gemma3TextConfig(
            sliding_window_pattern=2,
            rope_local_base_freq=100.0,
            rope_theta=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            final_logit_softcapping=4.0,
            **gemma,
        )
        model = Gemma3ForCausalLM(cfg)
    elif kind == "phi3":
        model = Phi3ForCausalLM(Phi3Config(pad_token_id=None, eos_token_id=None, **common))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, max_window_layers=1, **common))
    with torch.no_grad():  # make every norm weight (and Qwen2's biases) matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(0, 0.3)
    model.save_pretrained(out, safe_serialization=True)


_written: dict[tuple[str, str], dict[str, str]] = {}


def write_checkpoints(kinds, write, tok_dir: str, tmp_path_factory) -> dict[str, str]:
    """kind -> a checkpoint directory written by write(kind, dir), with the tokenizer of tok_dir;
    written once per session."""
    key = (tok_dir, write.__name__)
    if key not in _written:
        dirs = {}
        for kind in kinds:
            out = str(tmp_path_factory.mktemp(kind))
            write(kind, out)
            for f in os.listdir(tok_dir):
                if f.startswith("tokenizer") or f == "special_tokens_map.json":
                    shutil.copy(os.path.join(tok_dir, f), out)
            dirs[kind] = out
        _written[key] = dirs
    return _written[key]


def family_checkpoints(tok_dir: str, tmp_path_factory) -> dict[str, str]:
    """kind -> a checkpoint directory (with the tokenizer of tok_dir), written once per session."""
    return write_checkpoints(KINDS, hf_checkpoint, tok_dir, tmp_path_factory)


def long_workload(n: int = 5):
    """Prompts of 20-200 token ids (every other one sharing a 60-token prefix) and their max_tokens
    (6-14): contexts well past the window of WINDOW tokens."""
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(1, 370, (60,), generator=g).tolist()
    lens = [20, 140, 45, 200, 33][:n]
    prompts = []
    for i, length in enumerate(lens):
        own = torch.randint(1, 370, (length,), generator=g).tolist()
        prompts.append((shared + own)[:length] if i % 2 else own)
    return prompts, [6 + 2 * i for i in range(len(lens))]


def short_workload(n: int = 5):
    """Prompts of 3-18 token ids (every other one sharing a 12-token prefix) and their max_tokens
    (4-8), so that every context stays within the window."""
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(1, 370, (12,), generator=g).tolist()
    prompts = []
    for i in range(n):
        own = torch.randint(1, 370, (3 + 3 * i,), generator=g).tolist()
        prompts.append(shared + own[:6] if i % 2 else own)
    return prompts, [4 + i for i in range(n)]


def ours(path: str) -> DecoderForCausalLM:
    from transformers import AutoConfig

    model = build_model(AutoConfig.from_pretrained(path), TorchKernels())
    load_weights(model, path)
    return model.eval()


def one_prefill(n: int) -> AttentionMetadata:
    """n new tokens of one sequence, no KV history; the caches are unbound (empty)."""
    return AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        max_seqlen_q=n,
        max_seqlen_k=n,
        decode_only=False,
        no_history=True,
    )


@torch.inference_mode()
def prefill_logits(model: DecoderForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(model(ids, torch.arange(len(ids)), one_prefill(len(ids))))
