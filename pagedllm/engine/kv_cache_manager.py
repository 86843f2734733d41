"""KVCacheManager: maps sequences onto the block pool (prefix lookup, allocate, free, fork),
coordinating one manager per KV-cache group (single_type_kv_cache_manager.py: full attention,
sliding window) over the one pool, as vLLM v1's kv_cache_coordinator.py.

The three paths of a block (the names of the block trace, docs/architecture.md):
  ALLOCATE   - miss: a fresh block from the free queue's head
  REUSE      - hit on a block a live sequence holds: ref_cnt + 1
  REACTIVATE - hit on a free block that kept its hash: taken out of the free queue
Prefix hits are taken block by block in order and stop at the first miss; the last token
of a sequence is never served from the cache (its logits are needed). A hit is verified, not
trusted to the hash: same token ids, same extra keys (the request's cache_salt, hashed into its
first block) and computed after the same prefix as the previous block of the hit (block_pool.py).
Admissions are counted in `prefix_cache_stats`, a resume after preemption apart.

When blocks become findable (`cache_full_blocks`): as soon as the step that writes them is
scheduled. In that step's forward pass every layer stores K/V before it runs attention, and
later steps run after it on the same stream, so a reader of the same or a later step sees
written KV. Only blocks that the scheduled tokens complete and whose token ids are all known are
registered (a PLACEHOLDER token of async scheduling is registered when its id arrives); a step
that is never executed gives back what it registered (`uncache`).

Sharing (`fork`): a child takes every block of its parent by reference count; a shared block is
read-only, and a sequence about to write into a shared, partly filled last block gets a private
copy first (copy-on-write): `blocks_to_copy` lists (src, dst) pairs that the executor copies on
the KV tensor before the step's forward.

Groups: every group gives a sequence its own blocks for the same tokens, all from the one pool;
an allocation takes every group's blocks or none, so a sequence's tables always have one length.
The block hashes are the sequence's (one chain of its tokens), each group registering its own
blocks under them. A prefix hit is taken only
at a length where every group has one (`get_computed_blocks`): a full-attention hit can be cut
anywhere, a sliding-window hit only where its window's blocks are cached, so the length is
lowered until all agree.

Host tier (host_tier.py, `num_host_blocks` > 0): lookups continue into host memory where the
GPU pool misses, a hit's host blocks are loaded into new GPU blocks (`Transfers`, drained by
the scheduler into the step's SchedulerOutput), evicted GPU blocks are offloaded, and with
preemption_mode="swap" a preempted sequence's blocks are written there (`swap_out`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from pagedllm.engine.block_pool import Block, BlockHash, BlockHasher, BlockPool, HashFn
from pagedllm.engine.host_tier import HostBlock, HostTier, Transfers
from pagedllm.engine.kv_cache_groups import KVCacheGroup
from pagedllm.engine.sequence import Sequence
from pagedllm.engine.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager, manager_for
from pagedllm.engine.trace import Tracer


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, counted once per admission, in requests and tokens (vLLM v1's
    PrefixCacheStats). `queries` are the tokens of admitted sequences, `hits` those served from
    the cache. A sequence resumed after preemption re-hits the blocks it computed itself, so its
    lookups go to the preempted_* counters: queries and hits (and the hit rate) describe first
    admissions only. `host_hits` (and `preempted_host_hits`): the part of the hits loaded from
    the host tier (a block position counts there when any group's block came from it)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    host_hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    preempted_host_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool, num_host_hits: int = 0) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
            self.preempted_host_hits += num_host_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits
            self.host_hits += num_host_hits


@dataclass
class ComputedBlocks:
    """A prefix hit: `num_blocks` leading blocks of the sequence, per group the cached blocks
    (None where a sliding-window group needs no block: before its window)."""

    blocks: list[list[Block | None]]
    num_blocks: int = 0

    def __len__(self) -> int:
        return self.num_blocks


def cache_salt_key(salt: str | None) -> bytes:
    """The extra key of a first block: b"" without a salt, else a tagged, length-prefixed
    encoding (one salt can never read as another, or as no salt)."""
    if salt is None:
        return b""
    data = salt.encode("utf-8", "surrogatepass")
    return b"cache_salt" + len(data).to_bytes(4, "little") + data


class KVCacheManager:
    """`hash_algo` ("xxhash" or "sha256", SchedulerConfig.prefix_caching_hash_algo) and `hash_seed`
    (None: a secret drawn at construction) make the block hash (BlockHasher); `hash_fn` replaces
    it (tests inject collisions with it). `groups`: the model's KV-cache groups (one full-attention
    group when not given). `num_host_blocks`: the host tier's size (0: no tier)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        tracer: Tracer | None = None,
        hash_fn: HashFn | None = None,
        hash_algo: str = "xxhash",
        hash_seed: int | None = None,
        groups: Seq[KVCacheGroup] = (),
        num_host_blocks: int = 0,
    ) -> None:
        assert block_size >= 1, block_size  # SchedulerConfig refuses other sizes at the edge
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, tracer)
        # the host tier extends the prefix cache: nothing to keep without it
        self.host = HostTier(num_host_blocks, self.pool, tracer) if num_host_blocks and enable_prefix_caching else None
        self.groups = tuple(groups) or (KVCacheGroup((0,)),)
        self.managers: list[FullAttentionManager] = [
            manager_for(self.pool, g, block_size, group.sliding_window, self.host)
            for g, group in enumerate(self.groups)
        ]
        self.windowed_groups = frozenset(g for g, group in enumerate(self.groups) if group.sliding_window)
        # the window groups by window: the first of each answers has_skipped_blocks for all of them
        by_window: dict[int, list[SlidingWindowManager]] = {}
        for m in self.managers:
            if isinstance(m, SlidingWindowManager):
                by_window.setdefault(m.window, []).append(m)
        self.window_managers = list(by_window.values())
        self.hash_fn: HashFn = BlockHasher(hash_algo, hash_seed) if hash_fn is None else hash_fn
        self.prefix_cache_stats = PrefixCacheStats()
        self.blocks_to_copy: list[tuple[int, int]] = []  # copy-on-write, drained by the scheduler
        self.num_copy_on_writes = 0  # blocks copied because a sharer wrote into them (a counter, for metrics)

    # ---- views -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def num_blocks_by_group(self) -> list[int]:
        """Blocks each group holds now (ref_cnt > 0)."""
        return [self.pool.num_held_by_group[g] for g in range(len(self.groups))]

    def _block_key(self, seq: Sequence, i: int) -> tuple[tuple[int, ...], bytes]:
        """Block i's token ids and extra keys (the request's cache_salt, on block 0): what it is
        hashed from and verified against on a hit."""
        tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
        return tokens, cache_salt_key(seq.sampling_params.cache_salt) if i == 0 else b""

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[BlockHash]:
        """Chained hashes of the first num_full_blocks blocks (computed once, then kept)."""
        hashes = seq.block_hashes
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(self.hash_fn(parent, *self._block_key(seq, i)))
        return hashes

    def _give_tables(self, seq: Sequence) -> None:
        """One table per group for a sequence that holds no block yet."""
        n = len(self.groups)
        if len(seq.block_tables) != n:
            assert not any(seq.block_tables), seq
            seq.block_tables = [[] for _ in range(n)]
            seq.chain_prefix_ids = [None] * n
            seq.block_tables_version += 1

    # ---- scheduling API ------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> ComputedBlocks:
        """Longest cached prefix of a sequence not yet holding any block (in whole blocks), at a
        length every group agrees on. None for a sequence that needs prompt logprobs: every prompt
        position's logits must be computed."""
        self._give_tables(seq)
        none = ComputedBlocks([[] for _ in self.groups])
        if not self.enable_prefix_caching or any(seq.block_tables) or seq.needs_prompt_logprobs:
            return none
        n = (seq.num_tokens - 1) // self.block_size  # keep the last token to compute
        hashes = self._block_hashes(seq, n)
        hits: list[list[Block | None] | None] = [None] * len(self.groups)
        settled = False
        while not settled:  # n only falls: each pass either agrees or lowers it
            settled = True
            for g, manager in enumerate(self.managers):
                hit = hits[g]
                if hit is not None and len(hit) == n:
                    continue
                if hit is not None and not isinstance(manager, SlidingWindowManager):
                    hits[g] = hit[:n]  # a full-attention hit holds at any shorter length
                    continue
                hit = manager.find_longest_cache_hit(seq, hashes, self._block_key, n)
                hits[g] = hit
                if len(hit) < n:
                    n, settled = len(hit), False
        return ComputedBlocks([(hit or [])[:n] for hit in hits], n)

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        computed_blocks: ComputedBlocks | None = None,
        prefetch: bool = False,
    ) -> bool:
        """Give seq room for num_new_tokens more tokens after its computed ones (and after the
        prefix hit `computed_blocks`, which this call takes) in every group. False, with no block
        taken, when the pool cannot provide them (a sliding-window group may still have given
        back blocks that left its window: they are not needed whatever happens). prefetch: the
        hit's host blocks are read from the next step on (host_tier.py, LOAD)."""
        self._give_tables(seq)
        hit = computed_blocks if computed_blocks is not None and computed_blocks.num_blocks else None
        num_cached = hit.num_blocks * self.block_size if hit else 0
        first_new = seq.num_computed_tokens + num_cached
        total = first_new + num_new_tokens
        managers = self.managers
        for same_window in self.window_managers:
            if same_window[0].has_skipped_blocks(seq, first_new):
                for manager in same_window:
                    manager.remove_skipped_blocks(seq, first_new)
                seq.block_tables_version += 1
        # fast path: the tokens fit in blocks the sequence already holds (every group's table has
        # the same length) and nothing is shared to copy first (only a fork shares a partial block)
        if hit is None and total <= len(seq.block_tables[0]) * self.block_size:
            if not seq.kv_forked or not any(m.needs_copy_on_write(seq, num_new_tokens) for m in managers):
                return True
        hits: list[list[Block | None]] = hit.blocks if hit else [[] for _ in managers]
        need = sum(m.num_blocks_to_allocate(seq, total, h, num_new_tokens) for m, h in zip(managers, hits, strict=True))
        if need > self.pool.num_free_blocks:
            return False
        if seq.num_computed_tokens == 0 and not any(seq.block_tables):  # admitted: first time or resumed
            resumed = seq.num_preemptions > 0
            if self.enable_prefix_caching:
                from_host = sum(any(isinstance(h[i], HostBlock) for h in hits) for i in range(len(hit or ())))
                self.prefix_cache_stats.record(seq.num_tokens, num_cached, resumed, from_host * self.block_size)
            if not resumed:
                seq.num_cached_tokens = num_cached  # once: a resume re-hits blocks the sequence computed
        for m, h in zip(managers, hits, strict=True):
            m.take_hit(seq, h)  # every group's hit first: none may be allocated as another's new block
        for m, h in zip(managers, hits, strict=True):
            m.load_hits(seq, h, prefetch)  # then the GPU blocks that host-tier hits are loaded into
        if self.host is not None:
            self.host.release_swapped(seq.seq_id)  # admitted: what it swapped out is hit or lost
        for m in managers:
            self.num_copy_on_writes += m.allocate(seq, total, num_new_tokens, self.blocks_to_copy)
        seq.block_tables_version += 1
        if hit:
            seq.num_computed_tokens += num_cached
            seq.num_registered_blocks = hit.num_blocks
        return True

    def cache_full_blocks(self, seq: Sequence, num_scheduled_tokens: int) -> list[Block]:
        """Register the blocks that the sequence's first `num_scheduled_tokens` tokens fill (their
        writing step is scheduled: the module docstring) and whose token ids are all known (no
        PLACEHOLDER), in every group. Returns the blocks this call made findable (for `uncache`)."""
        if not self.enable_prefix_caching:
            return []
        num_full = min(num_scheduled_tokens, seq.num_tokens - seq.num_pending) // self.block_size
        start = seq.num_registered_blocks
        if num_full <= start:
            return []
        hashes = self._block_hashes(seq, num_full)
        registered: list[Block] = []
        for manager in self.managers:
            registered += manager.cache_full_blocks(seq, start, num_full, hashes, self._block_key)
        seq.num_registered_blocks = num_full
        return registered

    def rollback(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Speculative decoding (spec_verify.py): the sequence's computed length falls back to
        `num_computed_tokens` (rejected proposals' KV is not its own), and the blocks past it, which
        hold nothing else, go back to the pool in every group (ROLLBACK in the trace, then RELEASE).
        None of them is registered: a proposal's block is findable only once accepted."""
        assert num_computed_tokens <= seq.num_computed_tokens, (seq, num_computed_tokens)
        seq.num_computed_tokens = num_computed_tokens
        keep = -(-num_computed_tokens // self.block_size)
        assert seq.num_registered_blocks <= keep, seq
        if len(seq.block_tables[0]) > keep:
            for manager in self.managers:
                manager.trim(seq, keep)
            seq.block_tables_version += 1

    def uncache(self, blocks: list[Block], host_blocks: Seq[Block] = ()) -> None:
        """Make blocks that a step which never ran had registered unfindable again (their KV was
        never written): GPU blocks, and the host blocks of its offloads. Blocks computed after
        them in the chain become unreachable with them."""
        for block in blocks:
            self.pool.unregister(block)
        if self.host is not None:
            self.host.uncache(list(host_blocks))

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, each group's tail-first (its prefix outlives its suffix),
        and the host blocks held for it while preempted (swap)."""
        if self.host is not None:
            self.host.release_swapped(seq.seq_id)
        self._give_tables(seq)  # a sequence never looked up (aborted while waiting) has one table, not one per group
        for manager in self.managers:
            manager.free(seq)
        seq.block_tables_version += 1
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares every block of the parent by reference count (parallel sampling). Both
        hold the same token ids, so the child takes the parent's hashes and registered count."""
        assert not any(child.block_tables) and child.token_ids == parent.token_ids
        self._give_tables(child)
        for manager in self.managers:
            manager.fork(parent, child)
        parent.kv_forked = child.kv_forked = True
        child.block_tables_version += 1
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_registered_blocks = parent.num_registered_blocks
        child.block_hashes = list(parent.block_hashes)

    def swap_out(self, seq: Sequence) -> int:
        """preemption_mode="swap": write the sequence's registered blocks (every group) to the host
        tier and hold them there until it is admitted again; call before `free`. Returns the
        blocks held (0 without a tier)."""
        if self.host is None:
            return 0
        blocks = [
            self.pool.blocks[b]
            for table in seq.block_tables
            for b in table
            if b >= 0 and self.pool.blocks[b].block_hash is not None
        ]
        return self.host.swap_out(seq.seq_id, blocks)

    @property
    def has_host_tier(self) -> bool:
        return self.host is not None

    def hit_loads_from_host(self, hit: ComputedBlocks) -> bool:
        """Whether taking this hit loads blocks from the host tier."""
        return any(isinstance(b, HostBlock) for blocks in hit.blocks for b in blocks)

    def hit_waits_for_load(self, hit: ComputedBlocks) -> bool:
        """Whether this hit loads blocks from the host tier, or holds GPU blocks whose load is a
        prefetch of the step being scheduled (they hold their KV only from the next step on)."""
        if self.host is None:
            return False
        prefetching = self.host.prefetching
        return any(
            isinstance(b, HostBlock) or (prefetching and b is not None and b.block_id in prefetching)
            for blocks in hit.blocks
            for b in blocks
        )

    def take_transfers(self) -> Transfers:
        """The host-tier copies recorded for the step being scheduled (none without a tier)."""
        return self.host.take_transfers() if self.host is not None else Transfers()

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        out, self.blocks_to_copy = self.blocks_to_copy, []
        return out

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        if self.host is not None:
            self.host.reset()

    def check_invariants(self) -> None:
        self.pool.check_invariants(self.windowed_groups)
        if self.host is not None:
            self.host.check_invariants(self.windowed_groups)
