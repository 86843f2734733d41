"""KV-cache groups: the layers of a model grouped by attention kind (vLLM v1's hybrid allocator).

A layer either attends to its whole context (full attention) or to the last `sliding_window`
tokens only: a query at position q sees the keys at positions k with q - window < k <= q
(HF transformers' sliding-window mask). Layers of one kind need the same blocks, so they share
block tables; layers of different kinds do not (a sliding-window layer can give back the blocks
that have left its window while a full-attention layer keeps them).

Every group has the same number of layers, `group_size` (the last group of a kind may leave
some of its slots unused), so one block is the same number of bytes whatever group holds it: the
KV tensor is [group_size] layer slots x num_blocks blocks, block ids come from one pool, and
slot j of a block that group g holds belongs to the j-th layer of g. A model of one kind is one
group of all its layers: the KV layout of a plain model, unchanged.

The group size follows vLLM (`_get_kv_cache_groups_uniform_page_size`): the smallest number of
layers of one kind, or the largest when no kind has 25% more layers than another (less padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers (model order indices) that share block tables; `sliding_window` None: full attention."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None = None

    @property
    def kind(self) -> str:
        return "full_attention" if self.sliding_window is None else "sliding_window"

    def __post_init__(self) -> None:
        if not self.layer_ids:
            raise ValueError("a KV-cache group needs at least one layer")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive integer, got {self.sliding_window}")


def kv_cache_groups(layer_windows: Sequence[int | None]) -> tuple[KVCacheGroup, ...]:
    """Group layers by their window (None: full attention), full-attention groups first, each kind's
    layers in model order and cut into groups of one common size."""
    if not layer_windows:
        raise ValueError("a model needs at least one attention layer")
    kinds: dict[int | None, list[int]] = {}
    for i, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(i)
    sizes = [len(layers) for layers in kinds.values()]
    size = max(sizes) if max(sizes) < 1.25 * min(sizes) else min(sizes)
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    return tuple(KVCacheGroup(tuple(kinds[w][i : i + size]), w) for w in order for i in range(0, len(kinds[w]), size))


def group_size(groups: Sequence[KVCacheGroup]) -> int:
    """Layer slots per block: the size of the largest group."""
    return max(len(g.layer_ids) for g in groups)


def layer_slots(groups: Sequence[KVCacheGroup], num_layers: int) -> list[tuple[int, int]]:
    """For each layer (model order): (its group's index, its slot in the KV tensor)."""
    out: list[tuple[int, int] | None] = [None] * num_layers
    for g, group in enumerate(groups):
        for slot, layer in enumerate(group.layer_ids):
            out[layer] = (g, slot)
    missing = [i for i, s in enumerate(out) if s is None]
    if missing:
        raise ValueError(f"layers {missing} are in no KV-cache group")
    return [s for s in out if s is not None]


def blocks_per_sequence(
    groups: Sequence[KVCacheGroup], num_tokens: int, block_size: int, max_chunk: int | None = None
) -> int:
    """The most blocks one sequence of num_tokens tokens holds at once, over all groups, when its
    steps compute at most max_chunk tokens (None: any number). A full-attention group holds every
    block; a sliding-window group the blocks of its window before a step's first token, plus the
    blocks the step writes (single_type_kv_cache_manager.py)."""
    full = -(-num_tokens // block_size)
    chunk = num_tokens if max_chunk is None else min(max_chunk, num_tokens)
    total = 0
    for g in groups or (KVCacheGroup((0,)),):
        w = g.sliding_window
        total += full if w is None else min(full, -(-(w - 1) // block_size) + 1 + -(-chunk // block_size))
    return total
