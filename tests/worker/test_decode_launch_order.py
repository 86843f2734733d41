"""Decode steps carry their launch order (AttentionMetadata.seq_order): the batch longest first, a
permutation of the batch, on every decode step and only there; PAGEDLLM_DECODE_LAUNCH_ORDER=batch
turns it off. The CPU kernels ignore it (the order changes the GPU kernel's time, not the result:
tests/ops/test_paged_attention.py), so the outputs are the same either way."""

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.ops.kernels import TorchKernels


def run(tiny_models, monkeypatch):
    seen = []
    attend = TorchKernels.attend

    def spy(self, q, k, v, k_cache, v_cache, meta, *args, **kwargs):
        order = None if meta.seq_order is None else meta.seq_order.cpu().numpy()
        seen.append((meta.decode_only, meta.seq_lens.cpu().numpy().copy(), order))
        return attend(self, q, k, v, k_cache, v_cache, meta, *args, **kwargs)

    monkeypatch.setattr(TorchKernels, "attend", spy)
    llm = LLM(tiny_models["qwen3"], device="cpu", num_kv_blocks=256, block_size=8)
    prompts = [[5 + i] * n for i, n in enumerate((3, 40, 17, 9, 40))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    llm.close()
    return [o.outputs[0].token_ids for o in outs], seen


def test_decode_steps_launch_longest_first(tiny_models, monkeypatch):
    tokens, seen = run(tiny_models, monkeypatch)
    decode = [(lens, order) for d, lens, order in seen if d]
    assert decode and all(order is None for d, _, order in seen if not d)
    for lens, order in decode:
        assert sorted(order.tolist()) == list(range(len(lens)))  # a permutation of the batch
        assert (np.diff(lens[order]) <= 0).all()  # longest first
    assert any(len(set(lens.tolist())) > 1 for lens, _ in decode)  # mixed lengths were ordered


def test_batch_order_switch(tiny_models, monkeypatch):
    longest, _ = run(tiny_models, monkeypatch)
    monkeypatch.setenv("PAGEDLLM_DECODE_LAUNCH_ORDER", "batch")
    tokens, seen = run(tiny_models, monkeypatch)
    assert all(order is None for _, _, order in seen)
    assert tokens == longest


def test_bad_launch_order_value_is_refused(tiny_models, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_DECODE_LAUNCH_ORDER", "shortest")
    with pytest.raises(ValueError, match="PAGEDLLM_DECODE_LAUNCH_ORDER"):
        LLM(tiny_models["qwen3"], device="cpu", num_kv_blocks=64, block_size=8)
