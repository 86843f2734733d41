"""Independent reference: HF transformers, float32, full recompute each step (no KV cache)."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_logits(path: str, token_ids: list[int]) -> torch.Tensor:
    return hf_model(path)(torch.tensor([token_ids])).logits[0, -1].float()


@torch.inference_mode()
def hf_greedy(path: str, prompt: list[int], max_tokens: int) -> list[int]:
    model = hf_model(path)
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()
