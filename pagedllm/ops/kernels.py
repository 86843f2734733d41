"""The kernels a model runs, chosen once from the device: `kernels_for(device)`.

Every layer that computes (RMSNorm, rotary, SiLU/GELU-and-mul, paged attention, MoE experts) is
given one `Kernels` object when the model is built and calls it; no layer looks at a tensor's device.
- `TorchKernels`: the torch references (fused_ref.py, attention_ref.py, moe_ref.py). The CPU path, and
  the oracle of the kernel tests (tests/ops), which therefore test what the CPU path runs;
  its paged attention is the references' grouped form (decode rows batched by length), tested
  equal to the looped `paged_attention_ref` in tests/ops/test_attention_ref.py.
- `TritonKernels`: the Triton kernels (fused.py, store_kv.py, prepare_qkv.py, paged_attention.py, fused_moe.py,
  fused_moe_quant.py), on CUDA.

The KV caches are in the model's dtype or in fp8 (ops/kv_quant.py); `store_kv` and `attend` take
the layer's K and V scales, which only an fp8 cache uses. `prepare_qkv` is what a layer calls
between its QKV projection and attention: q/k norm, rotary and the KV store, one launch on GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from pagedllm.ops.attention_ref import (
    as_stored,
    paged_attention_grouped,
    paged_decode_attention_grouped,
    prefill_attention_ref,
    store_kvcache_ref,
)
from pagedllm.ops.fused_ref import apply_rotary_ref, gelu_tanh_and_mul_ref, rms_norm_ref, silu_and_mul_ref
from pagedllm.ops.moe_quant import ExpertStack, quant_moe_ref
from pagedllm.ops.moe_ref import fused_moe_ref, select_experts

if TYPE_CHECKING:
    from pagedllm.ops.attention_metadata import AttentionMetadata


class Kernels(Protocol):
    """Shapes: x [T, H]; q [T, Hq, D]; k/v [T, Hkv, D]; caches [num_blocks, Hkv, block_size, D]."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
        """weight * normalise(x); unit_offset: (1 + weight) * normalise(x) in fp32 (Gemma)."""
        ...

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual)."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2I] -> silu(gate) * up, gate the first half (SwiGLU)."""
        ...

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2I] -> gelu_tanh(gate) * up, gate the first half (GeGLU, HF's gelu_pytorch_tanh)."""
        ...

    def apply_rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotated (q, k); an implementation may rotate q and k in place."""
        ...

    def select_experts(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool, round_weights: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MoE routing, [T, E] logits -> (weights [T, k] float32, ids [T, k] int32): softmax in
        float32, the k largest, renormalised to sum 1 if asked, rounded to the logits' dtype if
        asked (ops/moe_ref.py)."""
        ...

    def fused_moe(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """Mixture of experts, x [T, H] -> [T, H]: sum over each token's k experts (topk_ids [T, k]
        int32, topk_weights [T, k] float32) of weight * down(silu(gate(x)) * up(x)); w13 [E, 2I, H]
        (gate rows then up rows), w2 [E, H, I] (ops/moe_ref.py)."""
        ...

    def fused_moe_quant(
        self, x: torch.Tensor, w13: ExpertStack, w2: ExpertStack, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """fused_moe with FP8 or 4-bit experts, both stacks of one kind (ops/moe_quant.py: quant_moe_ref)."""
        ...

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Write k/v at slot_mapping; an fp8 cache stores saturate(k / k_scale), saturate(v / v_scale)."""
        ...

    def prepare_qkv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None,
        eps: float,
        unit_offset: bool,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention block after the QKV projection, before attention: rms_norm of every q
        and k head (weights given, both or neither; unit_offset as rms_norm's), apply_rotary,
        then store_kv of that k and v (not when k_cache is empty: no KV bound). Returns the
        prepared (q, k); an implementation may rewrite q and k in place."""
        ...

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Attention of q over its sequence's context, read from the caches (dequantized with
        k_scale / v_scale if fp8); empty caches (the profiling run, before the KV tensor exists)
        mean the new tokens attend to each other only, unquantized.

        sliding_window W: the query at position q sees only keys at q - W < k <= q (HF's mask);
        block-table entries of blocks wholly before the first query's window may name any block
        (a sliding-window group gives those blocks back) and are never read. logits_soft_cap c:
        scores s = scale * q.k become c * tanh(s / c) before the mask and softmax (Gemma 2)."""
        ...


class TorchKernels:
    """The exact references; used on CPU."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
        return rms_norm_ref(x, weight, eps, unit_offset=unit_offset)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm_ref(x, weight, eps, residual, unit_offset)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_ref(x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul_ref(x)

    def apply_rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_ref(q, k, cos_sin_cache, positions)

    def select_experts(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool, round_weights: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(router_logits, top_k, renormalize, round_weights)

    def fused_moe(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)

    def fused_moe_quant(
        self, x: torch.Tensor, w13: ExpertStack, w2: ExpertStack, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return quant_moe_ref(x, w13, w2, topk_weights, topk_ids)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def prepare_qkv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None,
        eps: float,
        unit_offset: bool,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # the composition of this class's own methods, call for call as the layers made them before
        if (q_norm_weight is None) != (k_norm_weight is None):
            raise ValueError("prepare_qkv: q_norm_weight and k_norm_weight must be given both or neither")
        if q_norm_weight is not None and k_norm_weight is not None:
            form: dict[str, bool] = {"unit_offset": True} if unit_offset else {}
            q, k = self.rms_norm(q, q_norm_weight, eps, **form), self.rms_norm(k, k_norm_weight, eps, **form)
        q, k = self.apply_rotary(q, k, cos_sin_cache, positions)
        if k_cache.numel():
            self.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return q, k

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        if not k_cache.numel():
            return prefill_attention_ref(
                q, k, v, meta.cu_seqlens_q, scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap
            )
        if meta.no_history:  # pure prefill: attend over the new tokens directly, as the cache holds them
            k, v = as_stored(k, k_scale, k_cache.dtype), as_stored(v, v_scale, v_cache.dtype)
            return prefill_attention_ref(
                q, k, v, meta.cu_seqlens_q, scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap
            )
        if meta.decode_only:  # batched in groups of similar length, never padded to the longest
            return paged_decode_attention_grouped(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                k_scale,
                v_scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )
        return paged_attention_grouped(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seq_lens,
            scale,
            k_scale,
            v_scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )


class TritonKernels:
    """The Triton kernels; imported when constructed (CUDA only), so CPU never imports triton."""

    def __init__(self) -> None:
        from pagedllm.ops import fused, fused_moe, fused_moe_quant, paged_attention, prepare_qkv, store_kv

        self._rms_norm = fused.rms_norm
        self._silu_and_mul = fused.silu_and_mul
        self._gelu_tanh_and_mul = fused.gelu_tanh_and_mul
        self._apply_rotary = fused.apply_rotary
        self._store_kvcache = store_kv.store_kvcache
        self._prepare_qkv = prepare_qkv.prepare_qkv
        self._paged_attention = paged_attention.paged_attention
        self._fused_moe = fused_moe.fused_moe
        self._select_experts = fused_moe.select_experts
        self._fused_moe_quant = fused_moe_quant.fused_moe_quant

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
        return self._rms_norm(x, weight, eps, unit_offset=unit_offset)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rms_norm(x, weight, eps, residual, unit_offset)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._gelu_tanh_and_mul(x)

    def apply_rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._apply_rotary(q, k, cos_sin_cache, positions)  # in place

    def select_experts(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool, round_weights: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._select_experts(router_logits, top_k, renormalize, round_weights)

    def fused_moe(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return self._fused_moe(x, w13, w2, topk_weights, topk_ids)

    def fused_moe_quant(
        self, x: torch.Tensor, w13: ExpertStack, w2: ExpertStack, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return self._fused_moe_quant(x, w13, w2, topk_weights, topk_ids)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        self._store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def prepare_qkv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None,
        eps: float,
        unit_offset: bool,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # one launch (ops/prepare_qkv.py); q and k in place
        return self._prepare_qkv(
            q, k, v, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, unit_offset,
            k_cache, v_cache, slot_mapping, k_scale, v_scale,
        )  # fmt: skip

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        if not k_cache.numel():  # the profiling run, before the KV tensor exists
            return prefill_attention_ref(
                q, k, v, meta.cu_seqlens_q, scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap
            )
        return self._paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seq_lens,
            scale,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            k_scale=k_scale,
            v_scale=v_scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            seq_order=meta.seq_order if meta.decode_only else None,
        )


def kernels_for(device: torch.device) -> Kernels:
    """Triton on CUDA, the torch references elsewhere."""
    return TritonKernels() if device.type == "cuda" else TorchKernels()
