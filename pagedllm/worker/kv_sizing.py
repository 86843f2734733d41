"""The one KV tensor at start-up: how many blocks it gets, then its allocation and its report.

The block count, the first of these that applies: `num_kv_blocks` as given;
`kv_cache_memory_bytes` over what one block id costs (`pool_block_bytes`: the target's KV and,
with a draft model, the draft's); on CUDA the profile run (warm_up.profile_kv_blocks: total *
gpu_memory_utilization - used - peak + current, docs/architecture.md); on CPU a tenth of the
available RAM, at most what max_num_seqs full-length sequences need and at least one such
sequence. The ModelRunner then agrees the count across tensor-parallel ranks (parallel.agree_min)
before it allocates: the tensor is allocated once (kv_cache.py) and logged with the fp8 K/V
scales where the cache is fp8 (kv_scales.py chose them before sizing).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch

from pagedllm.engine.kv_cache_groups import blocks_per_sequence
from pagedllm.ops.kv_quant import is_fp8
from pagedllm.worker.device import available_ram_bytes
from pagedllm.worker.kv_cache import allocate_kv_cache, log_kv_cache
from pagedllm.worker.warm_up import profile_kv_blocks

if TYPE_CHECKING:
    from pagedllm.engine.kv_cache_groups import KVCacheGroup
    from pagedllm.model.attention import Attention
    from pagedllm.worker.runner_view import WarmUpRunner

logger = logging.getLogger("pagedllm")


class KVAllocRunner(Protocol):
    """What the allocation and its report read of the ModelRunner (model_runner.py)."""

    attn_layers: list[Attention]
    num_kv_blocks: int
    block_size: int
    kv_dtype: torch.dtype
    device: torch.device
    weights_bytes: int
    peak_activation_bytes: int
    kv_scales: list[tuple[float, float]]
    kv_scales_source: str
    kv_cache_groups: tuple[KVCacheGroup, ...]

    @property
    def kv_cache_dtype(self) -> str: ...


def size_kv_cache(
    runner: WarmUpRunner, num_kv_blocks: int | None, kv_cache_memory_bytes: int | None, gpu_memory_utilization: float
) -> tuple[int, int, str]:
    """(the block count, the peak activation bytes the profile run measured: 0 where none ran,
    which rule sized it: "sized by ...", for messages)."""
    if num_kv_blocks is not None:
        return int(num_kv_blocks), 0, "sized by num_kv_blocks"
    if kv_cache_memory_bytes is not None:
        return max(1, int(kv_cache_memory_bytes) // runner.pool_block_bytes), 0, "sized by kv_cache_memory_bytes"
    if runner.device.type == "cuda":
        return (*profile_kv_blocks(runner, gpu_memory_utilization), "sized by the profile run")
    # CPU: a tenth of available RAM, no more than max_num_seqs full-length sequences need
    one = blocks_per_sequence(
        runner.kv_cache_groups, runner.max_model_len, runner.block_size, runner.max_num_batched_tokens
    )
    blocks = max(one, min(runner.max_num_seqs * one, available_ram_bytes() // 10 // runner.pool_block_bytes))
    return blocks, 0, "sized by a tenth of the RAM"


def allocate_and_log_kv_cache(runner: KVAllocRunner) -> torch.Tensor:
    """The zeroed KV tensor of runner.num_kv_blocks blocks, every layer bound to it; logged."""
    groups = runner.kv_cache_groups
    kv_cache = allocate_kv_cache(
        runner.attn_layers, groups, runner.num_kv_blocks, runner.block_size, runner.kv_dtype, runner.device
    )
    log_kv_cache(
        kv_cache,
        runner.kv_cache_dtype,
        groups,
        runner.num_kv_blocks,
        runner.block_size,
        runner.weights_bytes,
        runner.peak_activation_bytes,
    )
    if is_fp8(runner.kv_dtype):
        ks, vs = [k for k, _ in runner.kv_scales], [v for _, v in runner.kv_scales]
        logger.info(
            "KV scales (%s): k %.4g..%.4g, v %.4g..%.4g over %d layers",
            runner.kv_scales_source,
            min(ks),
            max(ks),
            min(vs),
            max(vs),
            len(ks),
        )
    return kv_cache
