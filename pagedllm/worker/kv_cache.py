"""The one KV tensor: its layout over the KV-cache groups, its size in bytes and its allocation.

Layout (engine/kv_cache_groups.py): [2 (K, V), group_size layer slots, num_blocks, Hkv,
block_size, D]. A block id names one block of every slot; the group holding the block uses
slot j for its j-th layer. A model of one attention kind has one group of all its layers, so
slot j is layer j: the plain layout.

The KV bytes start zeroed: a finite 0.0 in every format, so a padded read of a never-written
slot adds nothing (ops/attention_ref.py); on CPU an O(1) lazily zeroed mapping
(device.zeroed_host_bytes).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from pagedllm.engine.kv_cache_groups import KVCacheGroup, group_size, kv_cache_groups, layer_slots
from pagedllm.model.attention import Attention
from pagedllm.worker.device import GiB, zeroed_host_bytes

logger = logging.getLogger("pagedllm")


def groups_of(layers: Sequence[Attention]) -> tuple[KVCacheGroup, ...]:
    """The KV-cache groups of a built model, from its attention layers' own windows."""
    return kv_cache_groups([layer.sliding_window for layer in layers])


def block_bytes(groups: Sequence[KVCacheGroup], layer: Attention, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one block id: K and V of block_size tokens for each of the group_size layer slots."""
    itemsize = torch.empty((), dtype=kv_dtype).element_size()  # 1 for fp8
    return 2 * group_size(groups) * layer.num_kv_heads * block_size * layer.head_dim * itemsize


def allocate_kv_cache(
    layers: Sequence[Attention],
    groups: Sequence[KVCacheGroup],
    num_blocks: int,
    block_size: int,
    kv_dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The zeroed KV tensor, with every layer bound to its slot's views and its group."""
    a = layers[0]
    shape = (2, group_size(groups), num_blocks, a.num_kv_heads, block_size, a.head_dim)
    nbytes = num_blocks * block_bytes(groups, a, block_size, kv_dtype)
    if device.type == "cpu":
        raw = zeroed_host_bytes(nbytes)
    else:
        raw = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    kv = raw.view(kv_dtype).view(shape)
    for layer, (g, slot) in zip(layers, layer_slots(groups, len(layers)), strict=True):
        layer.bind_kv_cache(kv[0, slot], kv[1, slot], g)
    return kv


def log_kv_cache(
    kv: torch.Tensor,
    dtype_name: str,
    groups: Sequence[KVCacheGroup],
    num_blocks: int,
    block_size: int,
    weights_bytes: int,
    peak_bytes: int,
) -> None:
    kinds = ", ".join(
        f"{len(g.layer_ids)} full" if g.sliding_window is None else f"{len(g.layer_ids)} window {g.sliding_window}"
        for g in groups
    )
    logger.info(
        "KV cache: %s, %d blocks x %d tokens = %.3f GiB (%d group%s of layers: %s); weights %.3f GiB; "
        "peak activations %.3f GiB",
        dtype_name,
        num_blocks,
        block_size,
        kv.numel() * kv.element_size() / GiB,
        len(groups),
        "" if len(groups) == 1 else "s",
        kinds,
        weights_bytes / GiB,
        peak_bytes / GiB,
    )
