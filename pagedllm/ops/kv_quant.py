"""The KV cache's storage formats: the model's dtype ("auto"), or one byte per element in fp8.

An fp8 cache holds `saturate(x * inv_scale)` and is read back as `stored * scale`, with one
float32 scale for K and one for V per layer (vLLM's per-tensor scheme; the runner takes them
from the checkpoint or measures them at start-up: worker/kv_scales.py). Saturation clamps to
the format's largest finite value before rounding, so a value past the calibrated range is
stored as +-max, never as inf or NaN. Rounding is to nearest, ties to even, in float32 on
both paths (the Triton store kernel and `quantize_ref`), so both write the same bytes.

For a cache in the model's dtype the scales are 1.0 and no kernel multiplies by them.
"""

from __future__ import annotations

import torch

# the fp8 names of kv_cache_dtype (engine/config.py KV_CACHE_DTYPES lists them all, with "auto")
FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,  # vLLM's spelling: fp8 means e4m3
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 format (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def inv_scale_of(scale: float) -> float:
    """1 / scale rounded to float32: the factor both store paths multiply by."""
    return float(torch.tensor(scale, dtype=torch.float32).reciprocal())


def quantize_ref(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's format: x unchanged in dtype for a non-fp8 cache, else saturate(x / scale)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    m = fp8_max(dtype)
    return (x.float() * inv_scale_of(scale)).clamp_(-m, m).to(dtype)


def dequantize_ref(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """What attention reads, in float32: stored * scale for fp8, the stored values otherwise."""
    if not is_fp8(stored.dtype):
        return stored.float()
    return stored.float() * scale


def bytes_view(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as uint8 (same bytes), for the torch ops CPU lacks for float8 (index_copy_);
    other caches unchanged."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
