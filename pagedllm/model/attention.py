"""Paged attention layer: prepare the new q/k (per-head q/k norm, rotary) and store the new K/V
through slot_mapping (one `Kernels.prepare_qkv` call: one launch on GPU), then attend over the
block tables, with the kernels the model was built with (ops/kernels.py).

An fp8 KV cache (ops/kv_quant.py) is read and written with this layer's K and V scales, set
once at start-up (from the checkpoint or measured: worker/kv_scales.py) before any step runs
or a CUDA graph is captured: the graphs bake them in."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.ops.attention_metadata import AttentionMetadata
from pagedllm.ops.kernels import Kernels


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        kernels: Kernels,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ):
        """sliding_window: this layer attends to the last `sliding_window` positions only (None:
        its whole context); logits_soft_cap: Gemma 2's tanh cap on the scores (Kernels.attend)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.kernels = kernels
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.kv_group = 0  # the KV-cache group whose block tables this layer reads (bind_kv_cache)
        # unbound (empty) until bind_kv_cache: the new tokens attend to each other only
        self.k_cache = self.v_cache = torch.tensor([])
        self.k_scale = self.v_scale = 1.0  # dequantized = stored * scale (fp8 caches only)
        # set by worker/kv_scales.py for its calibration forward only: [max |K|, max |V|] of the
        # prepared K and V as they enter attention, raised by every forward while it is a list
        self.kv_amax: list[float] | None = None

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_group: int = 0) -> None:
        """This layer's views of the KV tensor, [num_blocks, Hkv, block_size, D] each, and the
        KV-cache group (engine/kv_cache_groups.py) whose block tables and slot mapping index them.

        Bound after construction, not passed to it: the runner sizes the KV tensor by a profiling
        forward of the built model (worker/model_runner.py), so it cannot exist before the model."""
        self.k_cache, self.v_cache, self.kv_group = k_cache, v_cache, kv_group

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        if not (k_scale > 0 and v_scale > 0 and k_scale < float("inf") and v_scale < float("inf")):
            raise ValueError(f"KV scales must be finite and > 0, got k_scale={k_scale}, v_scale={v_scale}")
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        q_norm_weight: torch.Tensor | None = None,
        k_norm_weight: torch.Tensor | None = None,
        eps: float = 0.0,
        unit_offset: bool = False,
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D], as projected (not yet normed or rotated) -> [T, Hq, D].
        The q/k norm weights (Qwen3, Gemma 3; None: no q/k norm), eps and unit_offset are
        RMSNorm's; cos_sin_cache is the layer's rotary table (model/rotary.py)."""
        meta = meta.group(self.kv_group)
        q, k = self.kernels.prepare_qkv(
            q,
            k,
            v,
            positions,
            cos_sin_cache,
            q_norm_weight,
            k_norm_weight,
            eps,
            unit_offset,
            self.k_cache,
            self.v_cache,
            meta.slot_mapping,
            self.k_scale,
            self.v_scale,
        )
        if self.kv_amax is not None and k.numel():
            self.kv_amax[0] = max(self.kv_amax[0], float(k.detach().abs().amax()))
            self.kv_amax[1] = max(self.kv_amax[1], float(v.detach().abs().amax()))
        return self.kernels.attend(
            q,
            k,
            v,
            self.k_cache,
            self.v_cache,
            meta,
            self.scale,
            self.k_scale,
            self.v_scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )
