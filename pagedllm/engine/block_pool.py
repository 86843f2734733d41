"""The block pool: physical KV blocks, their reference counts, the LRU free queue and the
prefix-cache hash table. It knows nothing about scheduling policy.

Invariants (checked by `check_invariants`, exercised by the property tests):
- ref_cnt == 0  <=>  the block is in the free queue.
- A block with a hash is findable through `cached` until it is reallocated (lazy eviction);
  `cached[h]` holds exactly the blocks whose block_hash is h (several when two sequences
  computed the same content at the same time; any of them serves a hit).
- Allocation takes from the head of the free queue; freed blocks go to the tail.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import xxhash

from pagedllm.engine.trace import Tracer


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...] | list[int], extra: bytes = b"") -> int:
    """h_i = xxh64(h_{i-1} || token ids of block i || extra keys)."""
    h = xxhash.xxh64()
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra:
        h.update(extra)
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to verify a hash hit
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list with sentinels: popleft, append and remove are O(1)."""

    def __init__(self, blocks: list[Block]):
        self.head = Block(-1)
        self.tail = Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self.size

    def append(self, block: Block) -> None:
        last = self.tail.prev
        assert last is not None  # the sentinels are always linked
        last.next = block
        block.prev, block.next = last, self.tail
        self.tail.prev = block
        self.size += 1

    def popleft(self) -> Block:
        if self.size == 0:
            raise RuntimeError("no free KV blocks")
        block = self.head.next
        assert block is not None and block is not self.tail
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.size -= 1

    def __iter__(self) -> Iterator[Block]:
        b = self.head.next
        while b is not None and b is not self.tail:
            yield b
            b = b.next


class BlockPool:
    def __init__(self, num_blocks: int, tracer: Tracer | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, dict[int, Block]] = {}  # hash -> {block_id: block}
        self.tracer = tracer
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def _trace(self, kind: str, block: Block, seq_id: int | None) -> None:
        assert self.tracer is not None  # callers check first: no tracer, no cost
        self.tracer.event(kind, block.block_id, seq_id, block.ref_cnt, len(self.free_queue))

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> Block | None:
        """The cached block for this hash, only if its token ids match (no wrong KV on a collision)."""
        for block in self.cached.get(block_hash, {}).values():
            if block.token_ids == token_ids:
                return block
        return None

    def allocate(self, seq_id: int | None = None) -> Block:
        """ALLOCATE: the LRU head; a cached block found there is evicted now (lazy eviction)."""
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            self._uncache(block)
            block.block_hash = block.token_ids = None
            self.num_evictions += 1
            if self.tracer:
                self._trace("EVICT", block, seq_id)
        block.ref_cnt = 1
        if self.tracer:
            self._trace("ALLOCATE", block, seq_id)
        return block

    def touch(self, block: Block, seq_id: int | None = None) -> None:
        """REUSE a live block (ref_cnt+1) or REACTIVATE a free cached one (out of the free queue)."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
            kind = "REACTIVATE"
        else:
            kind = "REUSE"
        block.ref_cnt += 1
        if self.tracer:
            self._trace(kind, block, seq_id)

    def release(self, block: Block, seq_id: int | None = None) -> None:
        """RELEASE one reference; at zero the block joins the free queue's tail, hash kept."""
        assert block.ref_cnt > 0, f"double free of block {block.block_id}"
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue.append(block)
        if self.tracer:
            self._trace("RELEASE", block, seq_id)

    def _uncache(self, block: Block) -> None:
        h = block.block_hash
        assert h is not None
        same = self.cached[h]
        del same[block.block_id]
        if not same:
            del self.cached[h]

    def register(self, block: Block, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Make a block whose KV has been written findable under its hash."""
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached.setdefault(block_hash, {})[block.block_id] = block

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0 and block.block_hash is not None:
                self._uncache(block)
                block.block_hash = block.token_ids = None

    def check_invariants(self) -> None:
        in_queue = {b.block_id for b in self.free_queue}
        assert len(in_queue) == len(self.free_queue)
        for b in self.blocks:
            assert (b.ref_cnt == 0) == (b.block_id in in_queue), b
            assert b.ref_cnt >= 0
            assert b.block_hash is None or b.block_id in self.cached.get(b.block_hash, {}), b
        for h, same in self.cached.items():
            assert same and all(b.block_hash == h and b.block_id == i for i, b in same.items()), (h, same)
