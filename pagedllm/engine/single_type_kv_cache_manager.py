"""The blocks of one KV-cache group (kv_cache_groups.py) for every sequence, one rule per kind
(vLLM v1's single_type_kv_cache_manager.py). A sequence's table for group g is
`seq.block_tables[g]`: entry i holds the KV of its tokens [i * block_size, (i + 1) * block_size)
for the group's layers.

Full attention: a table holds every block of the sequence; a prefix hit is the longest run of
cached blocks from the first one.

Sliding window W: a query at position q reads keys q - W < k <= q only. Before a step whose
first new token is at position c, the blocks wholly before c - W + 1 are given back
(`remove_skipped_blocks`) and their entries become NULL_BLOCK, so a sequence holds at most
ceil((W - 1) / block_size) + 1 blocks of the group beside the blocks its step writes. Those
blocks keep their hashes in the free queue (lazy eviction), so another request can still hit
them. A prefix hit ending at block n needs only the blocks its next token reads, the
ceil((W - 1) / block_size) blocks before n (vLLM's SlidingWindowManager.find_longest_cache_hit),
or every block when the hit starts at the first one; the entries before them are NULL_BLOCK.

Chain verification (block_pool.py): each group registers its own blocks, after the prefix id of
the block before them in the same group (`seq.chain_prefix_ids[g]`: the last one registered or
hit). A hit chains its blocks on those ids. A window's run of blocks that does not start at the
first block cannot check what came before it (those blocks may be gone): its first block is
trusted to the hash chain, which is keyed by a per-process secret (or sha256), so nobody can
aim a collision at it. If a block of a window group was given back before its turn to be
registered (a window shorter than a block), the group's chain is broken for that sequence and
it registers nothing more (a lost hit, never wrong KV).

Host tier (host_tier.py): a lookup that misses in the GPU pool asks the host tier, so a hit may
hold host blocks (HostBlock) anywhere in its run; each takes a new GPU block that its KV is
loaded into (`take_hit`, then `load_hits` once every group's GPU hits are held).
"""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.engine.block_pool import ANY_PARENT, Block, BlockHash, BlockPool
from pagedllm.engine.host_tier import HostBlock, HostTier
from pagedllm.engine.sequence import Sequence

NULL_BLOCK = -1  # a table entry whose block a sliding-window group gave back; never read
BROKEN_CHAIN = -2  # seq.chain_prefix_ids[g]: registration stopped for this sequence's group

BlockKey = Callable[[Sequence, int], tuple[tuple[int, ...], bytes]]  # (seq, i) -> block i's (token ids, extra)


class FullAttentionManager:
    """Full attention reads every earlier position: it never gives a block back before the sequence ends."""

    def __init__(self, pool: BlockPool, group: int, block_size: int, host: HostTier | None = None) -> None:
        self.pool, self.group, self.block_size = pool, group, block_size
        self.host = host

    def lookup(self, block_hash: BlockHash, tokens: tuple[int, ...], extra: bytes, parent: int | None) -> Block | None:
        """A cached block of this group in the GPU pool, else in the host tier (block_pool.lookup)."""
        block = self.pool.lookup(block_hash, tokens, extra, parent, self.group)
        if block is None and self.host is not None:
            block = self.host.pool.lookup(block_hash, tokens, extra, parent, self.group)
        return block

    def find_longest_cache_hit(
        self, seq: Sequence, hashes: list[BlockHash], key: BlockKey, max_blocks: int
    ) -> list[Block | None]:
        hits: list[Block | None] = []
        parent: int | None = None
        for i in range(max_blocks):
            tokens, extra = key(seq, i)
            block = self.lookup(hashes[i], tokens, extra, parent)
            if block is None:
                break
            hits.append(block)
            parent = block.prefix_id
        return hits

    # ---- allocation ---------------------------------------------------------------------
    def num_blocks_to_allocate(
        self, seq: Sequence, total_tokens: int, hit: list[Block | None], num_new_tokens: int
    ) -> int:
        """Free-queue blocks that `allocate` takes: new ones, a copy-on-write copy, reactivated hits,
        a block for each host-tier hit to load."""
        table = seq.block_tables[self.group]
        new = max(0, -(-total_tokens // self.block_size) - len(table) - len(hit))
        cow = not hit and self.needs_copy_on_write(seq, num_new_tokens)
        return new + cow + sum(1 for b in hit if b is not None and (b.ref_cnt == 0 or isinstance(b, HostBlock)))

    def take_hit(self, seq: Sequence, hit: list[Block | None]) -> None:
        """Hold the blocks of a prefix hit (before any group allocates: a free hit block must not
        be handed out as a new one)."""
        table = seq.block_tables[self.group]
        for block in hit:
            if block is None:
                table.append(NULL_BLOCK)
            elif isinstance(block, HostBlock):
                assert self.host is not None
                self.host.pin(block, seq.seq_id)  # out of the host LRU: no offload may reuse it now
                table.append(NULL_BLOCK)  # until load_hits gives it a GPU block
            else:
                self.pool.touch(block, seq.seq_id)
                table.append(block.block_id)
        if hit:
            last = next((b for b in reversed(hit) if b is not None), None)
            seq.chain_prefix_ids[self.group] = None if last is None else last.prefix_id

    def load_hits(self, seq: Sequence, hit: list[Block | None], prefetch: bool = False) -> None:
        """A new GPU block for each host block of the hit (after every group took its GPU hits:
        the allocation may evict any free block), its KV loaded before the step's forward (before
        the next step's, for a prefetch)."""
        if self.host is None:
            return
        table = seq.block_tables[self.group]
        for i, block in enumerate(hit):
            if isinstance(block, HostBlock):
                gpu = self.pool.allocate(seq.seq_id, self.group)
                self.host.load(block, gpu, seq.seq_id, prefetch)
                table[i] = gpu.block_id

    def allocate(
        self, seq: Sequence, total_tokens: int, num_new_tokens: int, blocks_to_copy: list[tuple[int, int]]
    ) -> int:
        """Copy a shared last block about to be written, add new blocks up to total_tokens. Returns
        the number of copy-on-write copies (0 or 1)."""
        table = seq.block_tables[self.group]
        copies = 0
        if self.needs_copy_on_write(seq, num_new_tokens):
            self._copy_last_block(seq, blocks_to_copy)
            copies = 1
        for _ in range(-(-total_tokens // self.block_size) - len(table)):
            table.append(self.pool.allocate(seq.seq_id, self.group).block_id)
        return copies

    def needs_copy_on_write(self, seq: Sequence, num_new_tokens: int) -> bool:
        """A write into a partly filled last block that another sequence shares."""
        if num_new_tokens == 0 or seq.num_computed_tokens % self.block_size == 0:
            return False
        table = seq.block_tables[self.group]
        idx = seq.num_computed_tokens // self.block_size
        return idx < len(table) and table[idx] != NULL_BLOCK and self.pool.blocks[table[idx]].ref_cnt > 1

    def _copy_last_block(self, seq: Sequence, blocks_to_copy: list[tuple[int, int]]) -> None:
        table = seq.block_tables[self.group]
        idx = seq.num_computed_tokens // self.block_size
        src = self.pool.blocks[table[idx]]
        dst = self.pool.allocate(seq.seq_id, self.group)
        self.pool.release(src, seq.seq_id)
        table[idx] = dst.block_id
        blocks_to_copy.append((src.block_id, dst.block_id))

    # ---- prefix cache -------------------------------------------------------------------
    def cache_full_blocks(
        self, seq: Sequence, start: int, num_full: int, hashes: list[BlockHash], key: BlockKey
    ) -> list[Block]:
        """Register blocks start .. num_full - 1 of this group's table, each after the prefix of
        the one before it. Returns the blocks this call made findable."""
        table = seq.block_tables[self.group]
        chain = seq.chain_prefix_ids
        registered = []
        for i in range(start, num_full):
            if chain[self.group] == BROKEN_CHAIN:
                break
            if table[i] == NULL_BLOCK:  # given back before its turn: nothing after it can chain
                chain[self.group] = BROKEN_CHAIN
                break
            block = self.pool.blocks[table[i]]
            tokens, extra = key(seq, i)
            if self.pool.register(block, hashes[i], tokens, extra, chain[self.group] if i else None):
                registered.append(block)
            chain[self.group] = block.prefix_id
        return registered

    # ---- release and share --------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Release the blocks tail-first, so a prefix outlives its suffix in the LRU."""
        for block_id in reversed(seq.block_tables[self.group]):
            if block_id != NULL_BLOCK:
                self.pool.release(self.pool.blocks[block_id], seq.seq_id)
        seq.block_tables[self.group] = []
        seq.chain_prefix_ids[self.group] = None

    def trim(self, seq: Sequence, num_blocks: int) -> None:
        """Release the table's blocks past its first `num_blocks`, tail-first (a rollback: they
        hold only rejected proposals' KV, and no hash)."""
        table = seq.block_tables[self.group]
        while len(table) > num_blocks:
            block_id = table.pop()
            assert block_id != NULL_BLOCK, seq  # a window gives back blocks before the new tokens only
            block = self.pool.blocks[block_id]
            assert block.block_hash is None, block  # allocated for proposals in this step: never findable
            if self.pool.tracer:
                self.pool._trace("ROLLBACK", block, seq.seq_id)
            self.pool.release(block, seq.seq_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block the parent holds in this group, by reference count."""
        table = parent.block_tables[self.group]
        for block_id in table:
            if block_id != NULL_BLOCK:
                self.pool.touch(self.pool.blocks[block_id], child.seq_id)
        child.block_tables[self.group] = list(table)
        child.chain_prefix_ids[self.group] = parent.chain_prefix_ids[self.group]


class SlidingWindowManager(FullAttentionManager):
    """Groups of one window give back the same entries at the same time and take hits of the same
    shape (None before the window's run), so their tables' NULL_BLOCK entries always agree:
    `has_skipped_blocks` on one of them answers for all."""

    def __init__(
        self, pool: BlockPool, group: int, block_size: int, sliding_window: int, host: HostTier | None = None
    ) -> None:
        super().__init__(pool, group, block_size, host)
        self.window = sliding_window
        # blocks before a hit's end that its next token reads
        self.hit_blocks = -(-(sliding_window - 1) // block_size)

    def _num_skipped(self, table: list[int], first_new_position: int) -> int:
        """Entries of `table` wholly before the window of a step whose first new token is there."""
        return min(max(0, first_new_position - self.window + 1) // self.block_size, len(table))

    def has_skipped_blocks(self, seq: Sequence, first_new_position: int) -> bool:
        """A block wholly before the window of the step's first new token is still held."""
        table = seq.block_tables[self.group]
        n = self._num_skipped(table, first_new_position)
        return n > 0 and table[n - 1] != NULL_BLOCK

    def remove_skipped_blocks(self, seq: Sequence, first_new_position: int) -> None:
        """Give back the blocks wholly before the window of the step's first new token, from the
        newest such block back to the first entry already given back."""
        table = seq.block_tables[self.group]
        for i in range(self._num_skipped(table, first_new_position) - 1, -1, -1):
            if table[i] == NULL_BLOCK:
                break
            block = self.pool.blocks[table[i]]
            self.pool.release(block, seq.seq_id)
            if block.ref_cnt == 0:
                block.left_window = True  # not worth the host tier (host_tier.py)
            table[i] = NULL_BLOCK

    def find_longest_cache_hit(
        self, seq: Sequence, hashes: list[BlockHash], key: BlockKey, max_blocks: int
    ) -> list[Block | None]:
        """The longest hit whose next token finds every key of its window cached: a run of cached
        blocks, chained on their prefix ids, that starts at the first block or is hit_blocks long."""
        best = 0
        best_run: list[Block] = []
        run: list[Block] = []
        for i in range(max_blocks):
            tokens, extra = key(seq, i)
            if run:
                want = run[-1].prefix_id
            else:
                want = None if i == 0 else ANY_PARENT
            block = self.lookup(hashes[i], tokens, extra, want)
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) == i + 1 or len(run) >= self.hit_blocks:
                best, best_run = i + 1, run[-self.hit_blocks :] if self.hit_blocks else []
        hit: list[Block | None] = [None] * (best - len(best_run))
        return hit + list(best_run)


def manager_for(
    pool: BlockPool, group: int, block_size: int, sliding_window: int | None, host: HostTier | None = None
) -> FullAttentionManager:
    if sliding_window is None:
        return FullAttentionManager(pool, group, block_size, host)
    return SlidingWindowManager(pool, group, block_size, sliding_window, host)
