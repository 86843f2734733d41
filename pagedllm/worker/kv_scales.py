"""The K and V scales of an fp8 KV cache, one pair per layer (vLLM's per-tensor scheme).

Taken from the checkpoint when it has them (`model/loader.py` reads `...self_attn.k_scale`,
`v_scale`, or one `kv_scale` for both), otherwise measured at start-up: one forward over
`CALIBRATION_TOKENS` random token ids (seeded with the engine's seed) with no KV bound (the new tokens attend to each
other), recording each layer's largest |K| and |V| as they enter attention (after the q/k norm
and rotary). A measured scale maps HEADROOM times that largest value onto the format's largest
finite value, so values up to twice the calibration's range are stored unclipped, and larger ones
saturate (ops/kv_quant.py) instead of overflowing. With tensor parallelism the ranges are the max
over ranks, so every rank uses the scales TP=1 would.

Why a margin of 2: fp8 is floating point, so its relative precision (3 mantissa bits for e4m3)
is the same across the range; a wider range costs precision only below 2**-6 of the largest
value (e4m3's subnormals), where K and V entries contribute nothing measurable to attention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pagedllm.model.attention import Attention
from pagedllm.model.parallel import agree_max
from pagedllm.ops.kv_quant import fp8_max

CALIBRATION_TOKENS = 2048  # in sequences of CALIBRATION_SEQ_LEN tokens (or max_model_len, if shorter)
CALIBRATION_SEQ_LEN = 512
HEADROOM = 2.0
_TINY = 1e-12  # a layer whose K (or V) is all zeros still gets a finite, positive scale


def measure_kv_ranges(layers: Sequence[Attention], forward: Callable[[], None]) -> list[tuple[float, float]]:
    """(max |K|, max |V|) per layer over one call of `forward`, agreed over TP ranks."""
    amax = [[0.0, 0.0] for _ in layers]
    for layer, pair in zip(layers, amax, strict=True):
        layer.kv_amax = pair  # raised by Attention.forward, on the K/V it prepared (normed, rotated)
    try:
        forward()
    finally:
        for layer in layers:
            layer.kv_amax = None
    flat = agree_max([x for pair in amax for x in pair])
    return [(flat[2 * i], flat[2 * i + 1]) for i in range(len(layers))]


def scale_for(amax: float, dtype: torch.dtype) -> float:
    """The scale that stores amax * HEADROOM as the format's largest finite value."""
    return max(amax, _TINY) * HEADROOM / fp8_max(dtype)


def choose_kv_scales(
    layers: Sequence[Attention],
    checkpoint: dict[int, dict[str, float]],
    dtype: torch.dtype,
    forward: Callable[[], None],
) -> tuple[list[tuple[float, float]], str]:
    """Each layer's (k_scale, v_scale) and where they came from ("checkpoint", "measured" or
    "checkpoint + measured"). checkpoint: layer index -> {"k_scale": .., "v_scale": ..} as loaded."""
    names = ("k_scale", "v_scale")
    measure = any(not set(names) <= checkpoint.get(i, {}).keys() for i in range(len(layers)))
    measured: list[dict[str, float]] = [{} for _ in layers]
    if measure:  # the same on every TP rank (one checkpoint): measure_kv_ranges is collective
        ranges = measure_kv_ranges(layers, forward)
        measured = [{"k_scale": scale_for(k, dtype), "v_scale": scale_for(v, dtype)} for k, v in ranges]
    merged = [{**measured[i], **checkpoint.get(i, {})} for i in range(len(layers))]  # the checkpoint's win
    scales = [(m["k_scale"], m["v_scale"]) for m in merged]
    if not measure:
        source = "checkpoint"
    else:
        source = "checkpoint + measured" if checkpoint else "measured"
    return scales, source
