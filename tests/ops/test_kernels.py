"""The kernels a model runs are chosen once and passed to every layer (ops/kernels.py); the
CPU path runs exactly the references the kernel tests compare against; the attention
metadata is an argument of the forward, so nothing of a step outlives it."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from pagedllm.model.registry import build_model
from pagedllm.ops import PAD_SLOT_ID
from pagedllm.ops.attention_metadata import AttentionMetadata
from pagedllm.ops.fused_ref import apply_rotary_ref, rms_norm_ref, silu_and_mul_ref
from pagedllm.ops.kernels import Kernels, TorchKernels, kernels_for

LAYERS = 2


class CountingKernels(TorchKernels):
    """The references, counting calls; `fail_at` raises inside the n-th attention call."""

    def __init__(self, fail_at: int | None = None):
        self.calls: dict[str, int] = {}
        self.fail_at = fail_at

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def rms_norm(self, x, weight, eps):
        self._count("rms_norm")
        return super().rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x, residual, weight, eps):
        self._count("fused_add_rms_norm")
        return super().fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x):
        self._count("silu_and_mul")
        return super().silu_and_mul(x)

    def apply_rotary(self, q, k, cos_sin_cache, positions):
        self._count("apply_rotary")
        return super().apply_rotary(q, k, cos_sin_cache, positions)

    def prepare_qkv(self, *args):
        self._count("prepare_qkv")
        return super().prepare_qkv(*args)

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
        self._count("store_kv")
        super().store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attend(self, q, k, v, k_cache, v_cache, meta, scale, k_scale=1.0, v_scale=1.0, **window):
        self._count("attend")
        if self.calls["attend"] == self.fail_at:
            raise RuntimeError("kernel failed")
        return super().attend(q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale, **window)


def tiny_model(kernels: Kernels, num_blocks: int = 4, block_size: int = 4):
    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        architectures=["Qwen3ForCausalLM"],
    )
    model = build_model(cfg, kernels)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    kv = torch.zeros(2, LAYERS, num_blocks, 2, block_size, 16)
    for layer, k, v in zip(model.attention_layers(), kv[0], kv[1], strict=True):
        layer.bind_kv_cache(k, v)
    return model, kv


def prefill_meta(n: int, block_size: int = 4) -> AttentionMetadata:
    """One sequence of n new tokens in blocks 0, 1, ..."""
    return AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64),
        block_tables=torch.arange(-(-n // block_size), dtype=torch.int32)[None],
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        max_seqlen_q=n,
        max_seqlen_k=n,
        decode_only=False,
        no_history=True,
    )


def test_cpu_gets_the_references():
    k = kernels_for(torch.device("cpu"))
    assert type(k) is TorchKernels
    x, w, r = torch.randn(3, 16), torch.randn(16), torch.randn(3, 16)
    assert torch.equal(k.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    for got, want in zip(k.fused_add_rms_norm(x, r, w, 1e-6), rms_norm_ref(x, w, 1e-6, r), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(k.silu_and_mul(x), silu_and_mul_ref(x))
    q, kk, cache = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(10, 8)
    pos = torch.tensor([0, 5, 9])
    for got, want in zip(k.apply_rotary(q, kk, cache, pos), apply_rotary_ref(q, kk, cache, pos), strict=True):
        assert torch.equal(got, want)


def test_every_layer_runs_the_kernels_it_was_built_with():
    kernels = CountingKernels()
    model, kv = tiny_model(kernels)
    ids, pos = torch.tensor([3, 1, 4, 1, 5, 9]), torch.arange(6)
    hidden = model(ids, pos, prefill_meta(6))
    assert hidden.shape == (6, 32)
    # per layer: input norm, q and k norms (Qwen3), post-attention norm; then the final norm.
    # Only the first layer's input norm has no residual to add. The q/k norms, rotary and the
    # store are one prepare_qkv call (one launch on GPU), made of the three on CPU.
    assert kernels.calls == {
        "rms_norm": 1 + 2 * LAYERS,
        "fused_add_rms_norm": (LAYERS - 1) + LAYERS + 1,
        "silu_and_mul": LAYERS,
        "prepare_qkv": LAYERS,
        "apply_rotary": LAYERS,
        "store_kv": LAYERS,
        "attend": LAYERS,
    }
    assert kv[:, :, :2].abs().sum() > 0 and not kv[:, :, 2:].any()  # 6 tokens: blocks 0 and 1 only


def test_padding_slots_store_nothing():
    model, kv = tiny_model(TorchKernels())
    meta = prefill_meta(6)
    meta.slot_mapping[:] = PAD_SLOT_ID
    model(torch.tensor([3, 1, 4, 1, 5, 9]), torch.arange(6), meta)
    assert not kv.any()


def test_a_failed_forward_leaves_nothing_behind():
    ids, pos = torch.tensor([3, 1, 4, 1, 5, 9]), torch.arange(6)
    clean, _ = tiny_model(TorchKernels())
    want = clean(ids, pos, prefill_meta(6))

    failing = CountingKernels(fail_at=2)  # raises in the second layer's attention
    model, _ = tiny_model(failing)
    with pytest.raises(RuntimeError, match="kernel failed"):
        model(ids[:2], pos[:2], prefill_meta(2))
    # no module keeps the failed step's metadata ...
    for module in model.modules():
        assert not any(isinstance(v, AttentionMetadata) for v in vars(module).values()), module
    # ... and the next forward (with its own) computes what a model that never failed does
    assert torch.equal(model(ids, pos, prefill_meta(6)), want)


def test_kv_ranges_are_those_of_the_keys_and_values_attention_reads():
    """fp8 calibration (worker/kv_scales.py) measures K after the q/k norm and rotary, as attend gets it."""
    from pagedllm.worker.kv_scales import measure_kv_ranges

    seen: list[tuple[float, float]] = []

    class Recording(TorchKernels):
        def attend(self, q, k, v, *args, **kw):
            seen.append((float(k.abs().amax()), float(v.abs().amax())))
            return super().attend(q, k, v, *args, **kw)

    model, _ = tiny_model(Recording())
    layers = list(model.attention_layers())
    for layer in layers:  # unbound, as in the calibration forward
        layer.bind_kv_cache(torch.tensor([]), torch.tensor([]))
    ids, pos = torch.tensor([3, 1, 4, 1, 5, 9]), torch.arange(6)
    ranges = measure_kv_ranges(layers, lambda: model(ids, pos, prefill_meta(6)))
    assert ranges == seen and all(layer.kv_amax is None for layer in layers)
