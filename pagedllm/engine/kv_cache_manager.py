"""KVCacheManager: maps sequences onto the block pool (prefix lookup, allocate, free, fork).

The three paths of a block (the names of the block trace, ARCHITECTURE.md):
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
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.engine.block_pool import Block, BlockHash, BlockHasher, BlockPool, HashFn
from pagedllm.engine.sequence import Sequence
from pagedllm.engine.trace import Tracer


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, counted once per admission, in requests and tokens (vLLM v1's
    PrefixCacheStats). `queries` are the tokens of admitted sequences, `hits` those served from
    the cache. A sequence resumed after preemption re-hits the blocks it computed itself, so its
    lookups go to the preempted_* counters: queries and hits (and the hit rate) describe first
    admissions only."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


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
    it (tests inject collisions with it)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        tracer: Tracer | None = None,
        hash_fn: HashFn | None = None,
        hash_algo: str = "xxhash",
        hash_seed: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, tracer)
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

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    @staticmethod
    def _block_extra(seq: Sequence, i: int) -> bytes:
        """Extra keys of block i, hashed with its tokens and verified on a hit: the salt, on block 0."""
        return cache_salt_key(seq.sampling_params.cache_salt) if i == 0 else b""

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[BlockHash]:
        """Chained hashes of the first num_full_blocks blocks (computed once, then kept)."""
        hashes = seq.block_hashes
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(self.hash_fn(parent, self._block_tokens(seq, i), self._block_extra(seq, i)))
        return hashes

    # ---- scheduling API ------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> list[Block]:
        """Longest cached prefix of a sequence not yet holding any block (in whole blocks). None for
        a sequence that needs prompt logprobs: every prompt position's logits must be computed."""
        if not self.enable_prefix_caching or seq.block_table or seq.needs_prompt_logprobs:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size  # keep the last token to compute
        hits: list[Block] = []
        parent = None
        for i, h in enumerate(self._block_hashes(seq, max_blocks)):
            block = self.pool.lookup(h, self._block_tokens(seq, i), self._block_extra(seq, i), parent)
            if block is None:
                break
            hits.append(block)
            parent = block
        return hits

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[Block] | None = None) -> bool:
        """Give seq room for num_new_tokens more tokens after its computed ones (and after the
        prefix hit `computed_blocks`, which this call takes). False, with nothing changed,
        when the pool cannot provide the blocks."""
        if not computed_blocks:  # fast path: the tokens fit in blocks the sequence already holds
            total = seq.num_computed_tokens + num_new_tokens
            if total <= len(seq.block_table) * self.block_size and (
                seq.num_computed_tokens % self.block_size == 0
                or self.pool.blocks[seq.block_table[seq.num_computed_tokens // self.block_size]].ref_cnt == 1
            ):
                return True
        computed_blocks = computed_blocks or []
        num_cached = len(computed_blocks) * self.block_size
        total = seq.num_computed_tokens + num_cached + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(total) - len(seq.block_table) - len(computed_blocks))
        cow = self._needs_copy_on_write(seq, num_new_tokens) and not computed_blocks
        num_reactivated = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + cow + num_reactivated > self.pool.num_free_blocks:
            return False
        if seq.num_computed_tokens == 0 and not seq.block_table:  # admitted: first time or resumed
            resumed = seq.num_preemptions > 0
            if self.enable_prefix_caching:
                self.prefix_cache_stats.record(seq.num_tokens, num_cached, resumed)
            if not resumed:
                seq.num_cached_tokens = num_cached  # once: a resume re-hits blocks the sequence computed
        for block in computed_blocks:
            self.pool.touch(block, seq.seq_id)
            seq.block_table.append(block.block_id)
        if computed_blocks:
            seq.num_computed_tokens += num_cached
            seq.num_registered_blocks = len(computed_blocks)
        if cow:
            self._copy_last_block(seq)
        for _ in range(num_new_blocks):
            seq.block_table.append(self.pool.allocate(seq.seq_id).block_id)
        return True

    def _needs_copy_on_write(self, seq: Sequence, num_new_tokens: int) -> bool:
        """A write into a partly filled last block that another sequence shares."""
        if num_new_tokens == 0 or seq.num_computed_tokens % self.block_size == 0:
            return False
        idx = seq.num_computed_tokens // self.block_size
        return idx < len(seq.block_table) and self.pool.blocks[seq.block_table[idx]].ref_cnt > 1

    def _copy_last_block(self, seq: Sequence) -> None:
        idx = seq.num_computed_tokens // self.block_size
        src = self.pool.blocks[seq.block_table[idx]]
        dst = self.pool.allocate(seq.seq_id)
        self.pool.release(src, seq.seq_id)
        seq.block_table[idx] = dst.block_id
        self.blocks_to_copy.append((src.block_id, dst.block_id))
        self.num_copy_on_writes += 1

    def cache_full_blocks(self, seq: Sequence, num_scheduled_tokens: int) -> list[Block]:
        """Register the blocks that the sequence's first `num_scheduled_tokens` tokens fill (their
        writing step is scheduled: the module docstring) and whose token ids are all known (no
        PLACEHOLDER). Returns the blocks this call made findable (for `uncache`)."""
        if not self.enable_prefix_caching:
            return []
        num_full = min(num_scheduled_tokens, seq.num_tokens - seq.num_pending) // self.block_size
        if num_full <= seq.num_registered_blocks:
            return []
        hashes = self._block_hashes(seq, num_full)
        blocks = self.pool.blocks
        registered = []
        for i in range(seq.num_registered_blocks, num_full):
            parent = blocks[seq.block_table[i - 1]] if i else None
            tokens, extra = self._block_tokens(seq, i), self._block_extra(seq, i)
            block = blocks[seq.block_table[i]]
            if self.pool.register(block, hashes[i], tokens, extra, parent):
                registered.append(block)
        seq.num_registered_blocks = num_full
        return registered

    def uncache(self, blocks: list[Block]) -> None:
        """Make blocks that a step which never ran had registered unfindable again (their KV was
        never written). Blocks computed after them in the chain become unreachable with them."""
        for block in blocks:
            self.pool.unregister(block)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks tail-first, so its prefix outlives its suffix in the LRU."""
        for block_id in reversed(seq.block_table):
            self.pool.release(self.pool.blocks[block_id], seq.seq_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares every block of the parent by reference count (parallel sampling). Both
        hold the same token ids, so the child takes the parent's hashes and registered count."""
        assert not child.block_table and child.token_ids == parent.token_ids
        for block_id in parent.block_table:
            self.pool.touch(self.pool.blocks[block_id], child.seq_id)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_registered_blocks = parent.num_registered_blocks
        child.block_hashes = list(parent.block_hashes)

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        out, self.blocks_to_copy = self.blocks_to_copy, []
        return out

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
