"""The host tier: a second block pool over host memory that extends the prefix cache past the
GPU pool (vLLM's native KV offloading, SGLang's HiCache). It decides which GPU block goes to
which host block and back; the worker copies (worker/host_kv_cache.py).

Invariants (checked by `check_invariants`, exercised by tests/engine/test_host_tier*.py):
- A host block holds the KV of one GPU block, block for block (same layout and dtype): its
  hash, token ids, extra keys, parent_prefix_id and prefix_id are the GPU block's. Lookups verify
  tokens, extra keys (cache_salt) and the chain exactly as on the GPU (block_pool.py), and prefix
  ids name prefixes over both tiers (`BlockPool.peer`): a hit chain may run through both.
- No two cached host blocks of a group hold the same prefix (an offload of a prefix the tier
  already holds only refreshes it in the LRU).
- OFFLOAD: a cached GPU block is copied out when the GPU pool evicts it (lazy eviction: the
  step that reallocates it). The copy runs at the start of that step, before its loads, its
  copy-on-write copies and its forward, on the same stream as everything else, so it reads the
  KV the block held (written by earlier steps) before anything writes the block again. Eviction
  is the only moment a copy is certain to be needed; copying at registration would move every
  full block over PCIe whether or not it is ever evicted (docs/features/host-kv-tier.md).
- LOAD: a prefix hit that continues into the host tier takes a new GPU block per host block;
  the copy runs in the step that first reads it (after that step's offloads, before its forward),
  and the GPU block is registered (findable) from that step on, like a block the step computes.
  A prefetch (the load of a sequence admitted with no token to compute: it waits alone while the
  running sequences step, or the step's budget ran out) runs in the step before the one that reads
  it, beside that step's forward: no sequence of that step reads it (an admission whose hit holds
  a block being prefetched is itself admitted with no token: KVCacheManager.hit_waits_for_load),
  and the next step waits for it before its first copy.
  The host blocks of a step's loads are held (ref_cnt > 0: out of the host LRU) until the step
  is scheduled, so no offload of the same step can overwrite them first.
- A step that never runs gives back what it registered: its offloads' host blocks
  (`uncache`) and its loads' GPU blocks (the scheduler's new_cached).
- Swap (preemption_mode="swap"): a preempted sequence's registered blocks are written to the
  tier at once and held there for it until it is admitted again (its hits load them back) or
  finishes. A sequence holds host blocks only while it is preempted.
- Blocks a sliding-window group gave back because they left the window (`Block.left_window`)
  are not offloaded: a later hit reads only the window's blocks before its end.
- Once no request is left: every host block is free (ref_cnt 0), cached or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.engine.block_pool import Block, BlockPool
from pagedllm.engine.trace import Tracer


class HostBlock(Block):
    """A block of the host tier (same fields as a GPU block; its id indexes the host buffer)."""

    __slots__ = ()


class HostBlockPool(BlockPool):
    """A BlockPool of HostBlocks. Only its evictions are traced (HOST_EVICT): OFFLOAD and LOAD
    are the tier's own events, and its ALLOCATE/RELEASE would read as GPU blocks'."""

    block_type = HostBlock
    evict_event = "HOST_EVICT"

    def _trace(self, kind: str, block: Block, seq_id: int | None) -> None:
        if kind == self.evict_event:
            super()._trace(kind, block, seq_id)


@dataclass
class Transfers:
    """A step's copies between the tiers, in the order the worker runs them (offloads, then loads)."""

    offloads: list[tuple[int, int]] = field(default_factory=list)  # (GPU block, host block)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host block, GPU block)
    prefetches: list[tuple[int, int]] = field(default_factory=list)  # loads the next step reads (the same pairs)
    new_host_cached: list[Block] = field(default_factory=list)  # host blocks the offloads registered
    loaded: list[Block] = field(default_factory=list)  # GPU blocks the loads registered


@dataclass
class HostTierStats:
    """Blocks moved each way (counters); bytes are these times the executor's block bytes."""

    offloaded_blocks: int = 0
    loaded_blocks: int = 0
    prefetched_blocks: int = 0  # of loaded_blocks, those loaded a step ahead (beside the previous forward)
    swapped_out_blocks: int = 0


class HostTier:
    """The GPU pool's EvictionListener. `num_blocks` host blocks, none allocated at start."""

    def __init__(self, num_blocks: int, gpu: BlockPool, tracer: Tracer | None = None) -> None:
        self.pool = HostBlockPool(num_blocks, tracer)
        self.gpu = gpu
        self.tracer = tracer
        gpu.on_evict = self
        gpu.peer = self.pool
        self.pending = Transfers()
        self._pinned: list[Block] = []  # host blocks held for this step's loads
        self.prefetching: set[int] = set()  # GPU blocks this step's prefetches fill (read from the next step)
        self.swapped: dict[int, list[Block]] = {}  # seq_id -> host blocks held for it while preempted
        self.stats = HostTierStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(same) for same in self.pool.cached.values())

    def _event(self, kind: str, gpu: Block, host: Block, seq_id: int | None) -> None:
        if self.tracer is not None:
            self.tracer.event(
                kind, gpu.block_id, seq_id, gpu.ref_cnt, self.gpu.num_free_blocks, gpu.group, host.block_id
            )

    def lookup_like(self, block: Block) -> Block | None:
        """The cached host block holding the same prefix as a registered block, if any."""
        assert block.block_hash is not None and block.token_ids is not None
        return self.pool.lookup(block.block_hash, block.token_ids, block.extra, block.parent_prefix_id, block.group)

    # ---- offload -------------------------------------------------------------------------
    def evicted(self, block: Block, seq_id: int | None) -> None:
        """The GPU pool reallocates a cached block: keep its KV here (EvictionListener)."""
        if not block.left_window:
            self._offload(block, seq_id)

    def _offload(self, block: Block, seq_id: int | None) -> Block | None:
        """The host block that holds (or, once this step's copies run, will hold) block's KV;
        None when every host block is held."""
        have = self.lookup_like(block)
        if have is not None:
            if have.ref_cnt == 0:  # refresh: the tail of the LRU
                self.pool.free_queue.remove(have)
                self.pool.free_queue.append(have)
            return have
        if self.pool.num_free_blocks == 0:
            return None
        assert block.block_hash is not None and block.token_ids is not None
        host = self.pool.allocate(seq_id, block.group)  # may evict the host LRU's head (HOST_EVICT)
        self.pool.register(
            host, block.block_hash, block.token_ids, block.extra, block.parent_prefix_id, prefix_id=block.prefix_id
        )
        self.pool.release(host, seq_id)
        self.pending.offloads.append((block.block_id, host.block_id))
        self.pending.new_host_cached.append(host)
        self.stats.offloaded_blocks += 1
        self._event("OFFLOAD", block, host, seq_id)
        return host

    # ---- load ----------------------------------------------------------------------------
    def pin(self, host: Block, seq_id: int | None) -> None:
        """Hold a host block of a hit until the step is scheduled (before any GPU allocation of
        the admission can evict, offload and so reuse it)."""
        self.pool.touch(host, seq_id)
        self._pinned.append(host)

    def load(self, host: Block, gpu: Block, seq_id: int | None, prefetch: bool = False) -> None:
        """Copy a pinned host block into a newly allocated GPU block, which holds its prefix from now
        on. prefetch: no sequence of this step reads it (the scheduler admitted its sequence for the
        next step), so the copy may run beside this step's forward."""
        assert host.ref_cnt > 0 and host.block_hash is not None and host.token_ids is not None
        self.gpu.register(
            gpu, host.block_hash, host.token_ids, host.extra, host.parent_prefix_id, prefix_id=host.prefix_id
        )
        (self.pending.prefetches if prefetch else self.pending.loads).append((host.block_id, gpu.block_id))
        if prefetch:
            self.prefetching.add(gpu.block_id)
        self.pending.loaded.append(gpu)
        self.stats.loaded_blocks += 1
        self.stats.prefetched_blocks += prefetch
        self._event("LOAD", gpu, host, seq_id)

    # ---- swap ----------------------------------------------------------------------------
    def swap_out(self, seq_id: int, blocks: list[Block]) -> int:
        """Write a preempted sequence's registered blocks here and hold them for it. Returns how
        many are held (fewer when the tier has no free block left: the rest is recomputed)."""
        held = self.swapped.setdefault(seq_id, [])
        for block in blocks:
            before = len(self.pending.offloads)
            host = self._offload(block, seq_id)
            if host is None:
                break
            self.pool.touch(host, seq_id)
            held.append(host)
            self.stats.swapped_out_blocks += len(self.pending.offloads) - before
        return len(held)

    def release_swapped(self, seq_id: int) -> None:
        for host in self.swapped.pop(seq_id, ()):
            self.pool.release(host, seq_id)

    # ---- the step ------------------------------------------------------------------------
    def take_transfers(self) -> Transfers:
        """The copies recorded since the last call, for the step being scheduled; the step's
        load pins end here (the copies are queued in order from now on)."""
        for host in self._pinned:
            self.pool.release(host)
        self._pinned = []
        self.prefetching = set()
        out, self.pending = self.pending, Transfers()
        return out

    def uncache(self, host_blocks: list[Block]) -> None:
        """Offloads of a step that never ran: their host blocks hold no KV."""
        for host in host_blocks:
            self.pool.unregister(host)

    def reset(self) -> None:
        self.pool.reset_prefix_cache()

    def check_invariants(self, windowed_groups: frozenset[int] = frozenset()) -> None:
        self.pool.check_invariants(windowed_groups, held_parents_held=False)
        assert self.prefetching == {g for _, g in self.pending.prefetches}, (self.prefetching, self.pending.prefetches)
        held = sum(len(v) for v in self.swapped.values()) + len(self._pinned)
        assert sum(b.ref_cnt for b in self.pool.blocks) == held, (held, self.swapped, self._pinned)
        keys: dict[tuple[int, int | None, tuple[int, ...], bytes], int] = {}  # one prefix, one id: both tiers
        ids: dict[int, tuple[int, int | None, tuple[int, ...], bytes]] = {}
        for tier in (self.gpu, self.pool):
            for b in tier.blocks:
                if b.token_ids is None:
                    continue
                assert b.prefix_id is not None
                key = (b.group, b.parent_prefix_id, b.token_ids, b.extra)
                assert keys.setdefault(key, b.prefix_id) == b.prefix_id, b
                assert ids.setdefault(b.prefix_id, key) == key, b
        for same in self.pool.cached.values():  # no duplicates in the host tier (one hash may name several prefixes)
            prefixes = [(b.parent_prefix_id, b.token_ids, b.extra) for b in same.values()]
            assert len(set(prefixes)) == len(prefixes), same
