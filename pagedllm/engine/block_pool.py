"""The block pool: physical KV blocks, their reference counts, the LRU free queue and the
prefix-cache hash table. It knows nothing about scheduling policy.

Invariants (checked by `check_invariants`, exercised by the property tests):
- ref_cnt == 0  <=>  the block is in the free queue (blocks never allocated are its head,
  implicitly: `blocks` holds only those allocated at least once, ids 0 .. len(blocks) - 1).
- A block gets its hash when a step that writes its KV is scheduled (kv_cache_manager.py says
  why a reader of that step or a later one sees written KV) and loses it when it is reallocated
  (lazy eviction) or when that step never runs (`unregister`). Until then it is findable;
  `cached[h]` holds exactly the blocks whose block_hash is h. Several blocks share a hash when
  sequences computed the same prefix at the same time (duplicates), or when different prefixes
  collide (a crafted collision, a stub hash in a test): the hash only narrows the search.
- Hits are verified along the whole chain, never trusted to the hash. A registered block stores
  what its KV was computed from: its token ids, its extra keys (cache_salt, on a first block) and
  `parent_prefix_id`, the `prefix_id` of the block it was computed after (None: a first block).
  `prefix_id` names a whole prefix: registered blocks have equal prefix_ids exactly when their
  tokens, extra keys and parent_prefix_ids are equal (`register` gives a block the id of a
  cached block it duplicates, else a new one), so by induction from the first block, equal ids
  mean KV computed from the same tokens under the same salt. Ids come from a counter of the
  pool and are never reused: once a prefix's last block is evicted its id names nothing
  cached, and blocks computed after it can no longer be reached (a lost hit, never wrong KV).
- `lookup` accepts a candidate only when its tokens and extra keys equal the request's and its
  parent_prefix_id is the prefix_id of the request's previous hit: a hit chain holds KV of the
  request's own prefix, whatever collides with it. Duplicates of a prefix share its prefix_id,
  so any of them serves, and a chain may mix them.
- A held (ref_cnt > 0) registered block of a full-attention group has its parent prefix held
  too: whoever holds such a block holds the blocks before it in its block table, and a held block
  keeps its hash. A sliding-window group gives back the blocks that left its window, so there a
  held block's parent may be free or gone (`check_invariants(windowed_groups=...)`).
- KV-cache groups (kv_cache_groups.py): a block is held by one group at a time (`Block.group`,
  set when it is allocated; a hit never crosses groups: the hash table is keyed by group).
- Allocation takes from the head of the free queue; freed blocks go to the tail.
- Host tier (host_tier.py): a second pool of the same class over host memory. Its blocks adopt
  the prefix ids of the GPU blocks they copy, and a GPU block registered while the host tier
  holds a duplicate of it takes that duplicate's id (`peer`), so prefix ids name prefixes over
  both tiers and one hit chain may run through both: the "one prefix, one id" rule holds in the
  union. `on_evict` hears of a cached block just before it loses its hash to a reallocation.
"""

from __future__ import annotations

import array
import hashlib
import itertools
import secrets
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import xxhash

from pagedllm.engine.config import PREFIX_CACHING_HASH_ALGOS
from pagedllm.engine.trace import Tracer

BlockHash = bytes  # an xxh64 digest (8 bytes) or a sha256 digest (32 bytes): one kind per pool
HashFn = Callable[[BlockHash | None, tuple[int, ...], bytes], BlockHash]  # (parent, token ids, extra keys)


def _digest(data: bytes, algo: str, seed: int) -> BlockHash:
    if algo == "xxhash":
        return xxhash.xxh64_digest(data, seed=seed)
    if algo == "sha256":
        return hashlib.sha256(data).digest()
    raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(PREFIX_CACHING_HASH_ALGOS)}, got {algo!r}")


def hash_block(parent_hash: BlockHash, token_ids: Sequence[int], extra: bytes, *, algo: str, seed: int) -> BlockHash:
    """h_i = H(h_{i-1} || token ids of block i as int64 || extra keys), H xxh64 seeded with `seed`
    or sha256 (the seed then enters only through the chain's root, BlockHasher.root). The parent
    digest and the token ids have fixed lengths in a pool, so the fields cannot run into each other."""
    return _digest(parent_hash + array.array("q", token_ids).tobytes() + extra, algo, seed)


class BlockHasher:
    """The chain hash of one pool: `hasher(parent, token_ids, extra)`, parent None for a first block.

    The root (the parent digest of every first block) and xxh64's seed come from `seed`, a
    secret 64-bit integer drawn from the OS's random source when None: hashes are then
    unpredictable from outside the process, so nobody can precompute a collision offline. Tests
    pass a fixed seed. A pool keeps its hasher for life (hashes of two seeds never meet)."""

    def __init__(self, algo: str = "xxhash", seed: int | None = None) -> None:
        self.algo = algo
        self.seed = secrets.randbits(64) if seed is None else seed
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"hash seed must be an unsigned 64-bit integer, got {self.seed}")
        root_data = b"pagedllm prefix-cache root" + self.seed.to_bytes(8, "little")
        self.root = _digest(root_data, algo, self.seed)  # (and checks algo)

    def __call__(self, parent: BlockHash | None, token_ids: tuple[int, ...], extra: bytes = b"") -> BlockHash:
        return hash_block(self.root if parent is None else parent, token_ids, extra, algo=self.algo, seed=self.seed)


class EvictionListener(Protocol):
    def evicted(self, block: Block, seq_id: int | None) -> None:
        """`block` (still registered) is about to be reallocated, for `seq_id`."""


class Block:
    __slots__ = (
        "block_id",
        "left_window",
        "ref_cnt",
        "block_hash",
        "token_ids",
        "extra",
        "prefix_id",
        "parent_prefix_id",
        "group",
        "prev",
        "next",
    )

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        # set by register (None / b"" while unregistered): what the KV was computed from
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.extra: bytes = b""  # extra keys (cache_salt) hashed with the tokens
        self.prefix_id: int | None = None  # names the whole prefix this block ends (BlockPool's counter)
        self.parent_prefix_id: int | None = None  # the prefix it was computed after; None: a first block
        self.group = 0  # the KV-cache group that holds it (or held it last)
        # given back because it left a sliding window: not worth keeping in the host tier
        self.left_window = False
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex() if self.block_hash is not None else None
        return (
            f"Block({self.block_id}, group={self.group}, ref={self.ref_cnt}, hash={h}, prefix={self.prefix_id}, "
            f"parent={self.parent_prefix_id})"
        )


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


ANY_PARENT = -1  # `lookup`: accept a block computed after any prefix (the first block of a window's run)


class BlockPool:
    block_type: type[Block] = Block  # host_block_pool.HostBlock in the host tier
    evict_event = "EVICT"

    def __init__(self, num_blocks: int, tracer: Tracer | None = None):
        assert num_blocks >= 1, num_blocks  # SchedulerConfig refuses other sizes at the edge
        self.num_blocks = num_blocks
        # Blocks are made when first allocated, in id order: ids [len(blocks), num_blocks) were never
        # used and are the free queue's head, implicitly (nothing is freed before them), so a pool of
        # millions of blocks (a tiny model's default pool on a large GPU) starts in no time.
        self.blocks: list[Block] = []
        self.free_queue = FreeBlockQueue([])  # the free blocks that were used: after the never-used ones
        self.cached: dict[tuple[int, BlockHash], dict[int, Block]] = {}  # (group, hash) -> {block_id: block}
        self.tracer = tracer
        self.num_evictions = 0
        self.num_held_by_group: Counter[int] = Counter()  # group -> its blocks with ref_cnt > 0
        self._prefix_ids = itertools.count()  # Block.prefix_id: never reused
        self.on_evict: EvictionListener | None = None  # the host tier offloads what is evicted here
        self.peer: BlockPool | None = None  # the host tier: a duplicate there lends its prefix id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + self.num_blocks - len(self.blocks)

    def _trace(self, kind: str, block: Block, seq_id: int | None) -> None:
        assert self.tracer is not None  # callers check first: no tracer, no cost
        self.tracer.event(kind, block.block_id, seq_id, block.ref_cnt, self.num_free_blocks, block.group)

    def lookup(
        self,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        extra: bytes,
        parent_prefix_id: int | None,
        group: int = 0,
    ) -> Block | None:
        """A cached block of `group` computed from exactly these token ids and extra keys after the
        prefix `parent_prefix_id` (the prefix_id of the request's previous hit; None for a first
        block; ANY_PARENT: any), else None. Only the hash narrows the search: a collision can cost
        a miss, never wrong KV."""
        for block in self.cached.get((group, block_hash), {}).values():
            if (
                (parent_prefix_id == ANY_PARENT or block.parent_prefix_id == parent_prefix_id)
                and block.token_ids == token_ids
                and block.extra == extra
            ):
                return block
        return None

    def allocate(self, seq_id: int | None = None, group: int = 0) -> Block:
        """ALLOCATE: the LRU head; a cached block found there is evicted now (lazy eviction)."""
        if len(self.blocks) < self.num_blocks:  # a never-used block: the head of the queue
            block = self.block_type(len(self.blocks))
            self.blocks.append(block)
        else:
            block = self.free_queue.popleft()
        if block.block_hash is not None:
            if self.on_evict is not None:
                self.on_evict.evicted(block, seq_id)
            self._drop_hash(block)
            self.num_evictions += 1
            if self.tracer:
                self._trace(self.evict_event, block, seq_id)
        block.left_window = False
        block.ref_cnt = 1
        block.group = group
        self.num_held_by_group[group] += 1
        if self.tracer:
            self._trace("ALLOCATE", block, seq_id)
        return block

    def touch(self, block: Block, seq_id: int | None = None) -> None:
        """REUSE a live block (ref_cnt+1) or REACTIVATE a free cached one (out of the free queue)."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
            self.num_held_by_group[block.group] += 1
            block.left_window = False
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
            self.num_held_by_group[block.group] -= 1
        if self.tracer:
            self._trace("RELEASE", block, seq_id)

    def _drop_hash(self, block: Block) -> None:
        h = block.block_hash
        assert h is not None
        key = (block.group, h)
        same = self.cached[key]
        del same[block.block_id]
        if not same:
            del self.cached[key]
        block.block_hash = block.token_ids = block.prefix_id = block.parent_prefix_id = None
        block.extra = b""

    def register(
        self,
        block: Block,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        extra: bytes,
        parent_prefix_id: int | None,
        prefix_id: int | None = None,
    ) -> bool:
        """Make a held block findable under its hash (in its group) once a step that writes its KV
        is scheduled, remembering what the KV is computed from: token ids, extra keys and the
        prefix it follows, `parent_prefix_id` (the prefix_id of the block before it in the
        caller's block table; None: a first block). A duplicate of a cached prefix (here, or in
        `peer`) takes that prefix's id; `prefix_id` given: the id of the block whose KV this one
        copies (a load from, or an offload to, the other tier). False: it was registered already."""
        if block.block_hash is not None:
            return False  # shared (fork) and registered by another holder: the same prefix
        assert block.ref_cnt > 0 and parent_prefix_id != ANY_PARENT, (block, parent_prefix_id)
        if prefix_id is None:
            same = self.lookup(block_hash, token_ids, extra, parent_prefix_id, block.group)
            if same is None and self.peer is not None:
                same = self.peer.lookup(block_hash, token_ids, extra, parent_prefix_id, block.group)
            prefix_id = next(self._prefix_ids) if same is None else same.prefix_id
        block.prefix_id = prefix_id
        block.parent_prefix_id = parent_prefix_id
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.extra = extra
        self.cached.setdefault((block.group, block_hash), {})[block.block_id] = block
        return True

    def unregister(self, block: Block) -> None:
        """Undo `register`: the block is no longer findable (its KV was never written)."""
        if block.block_hash is not None:
            self._drop_hash(block)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0 and block.block_hash is not None:
                self._drop_hash(block)

    def check_invariants(self, windowed_groups: frozenset[int] = frozenset(), held_parents_held: bool = True) -> None:
        """held_parents_held False: skip the held-parent rule (the host tier holds blocks only to
        pin them while a copy is pending)."""
        in_queue = {b.block_id for b in self.free_queue}
        assert len(in_queue) == len(self.free_queue)
        prefix_of: dict[tuple[int, int | None, tuple[int, ...], bytes], int] = {}  # what a prefix id stands for
        ids: dict[int, tuple[int, int | None, tuple[int, ...], bytes]] = {}
        held_prefixes: set[int] = set()
        held_parents: set[int] = set()
        for b in self.blocks:
            assert (b.ref_cnt == 0) == (b.block_id in in_queue), b
            assert b.ref_cnt >= 0
            if b.block_hash is None:
                assert b.token_ids is None and b.prefix_id is None and b.parent_prefix_id is None and not b.extra, b
                continue
            assert b.token_ids is not None and b.prefix_id is not None, b
            assert b.block_id in self.cached.get((b.group, b.block_hash), {}), b
            key = (b.group, b.parent_prefix_id, b.token_ids, b.extra)
            assert prefix_of.setdefault(key, b.prefix_id) == b.prefix_id, b  # one prefix, one id
            assert ids.setdefault(b.prefix_id, key) == key, b  # one id, one prefix
            if b.ref_cnt > 0:
                held_prefixes.add(b.prefix_id)
                if b.parent_prefix_id is not None and b.group not in windowed_groups:
                    held_parents.add(b.parent_prefix_id)
        assert not held_parents_held or held_parents <= held_prefixes, held_parents - held_prefixes
        for (g, h), same in self.cached.items():
            assert same and all(b.block_hash == h and b.group == g and b.block_id == i for i, b in same.items()), same
