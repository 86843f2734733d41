"""The block pool's named scenarios (allocate, reuse, reactivate, evict) as tests, plus property tests
of every KV-cache invariant (docs/architecture.md)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.engine import KVCacheManager, SamplingParams, Sequence
from pagedllm.engine.block_pool import BlockHasher


def seq_of(tokens, rid="r"):
    return Sequence(rid, tokens, SamplingParams())


def admit(kv: KVCacheManager, seq: Sequence) -> bool:
    """Prefill a whole prompt in one go and mark its KV written, as a step would."""
    computed = kv.get_computed_blocks(seq)
    num_new = seq.num_tokens - len(computed) * kv.block_size
    if not kv.allocate_slots(seq, num_new, computed):
        return False
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq, seq.num_tokens)
    return True


def test_two_requests_share_a_256_token_prefix():
    trace = []
    from pagedllm.engine.trace import Tracer

    kv = KVCacheManager(num_blocks=64, block_size=256, tracer=Tracer(trace))
    prefix = list(range(256))
    a, b = seq_of(prefix + [1, 2, 3], "a"), seq_of(prefix + [7, 8], "b")
    assert admit(kv, a)
    assert admit(kv, b)
    assert b.block_table[0] == a.block_table[0]  # block 0 reused
    assert b.block_table[1] != a.block_table[1]  # own tail block
    assert kv.pool.blocks[a.block_table[0]].ref_cnt == 2
    assert b.num_cached_tokens == 256
    assert [e["event"] for e in trace] == ["ALLOCATE", "ALLOCATE", "REUSE", "ALLOCATE"]
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == kv.num_blocks


def test_finished_request_blocks_are_reactivated():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(10))
    a = seq_of(prompt)
    admit(kv, a)
    old = list(a.block_table)
    kv.free(a)
    assert kv.num_free_blocks == 16
    b = seq_of(prompt + [99])
    admit(kv, b)
    assert b.block_table[:2] == old[:2]
    assert b.num_cached_tokens == 8
    assert kv.prefix_cache_stats.hits == 8


def test_last_prompt_token_is_always_computed():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = seq_of(list(range(8)))
    admit(kv, a)
    b = seq_of(list(range(8)))  # identical, block-aligned prompt
    computed = kv.get_computed_blocks(b)
    assert len(computed) == 1  # not 2: token 7 must be computed


def _two_freed(num_blocks=8):
    """old and recent each hold 2 full (hashed) blocks + 1 partial; old is freed first.
    Free queue afterwards: 2 never-used, old (partial, b1, b0), recent (partial, b1, b0)."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4)
    old, recent = seq_of(list(range(100, 108)) + [0], "old"), seq_of(list(range(200, 208)) + [0], "recent")
    admit(kv, old)
    admit(kv, recent)
    kv.free(old)
    kv.free(recent)
    return kv


def test_lru_evicts_the_oldest_freed_blocks_first():
    kv = _two_freed()
    admit(kv, seq_of(list(range(300, 320)), "filler"))  # 5 blocks: 2 unused + all of old's
    assert kv.pool.num_evictions == 2
    assert len(kv.get_computed_blocks(seq_of(list(range(100, 108)) + [5]))) == 0
    assert len(kv.get_computed_blocks(seq_of(list(range(200, 208)) + [5]))) == 2  # recent stays findable


def test_lru_prefix_outlives_suffix():
    kv = _two_freed()
    admit(kv, seq_of(list(range(300, 316)), "filler"))  # 4 blocks: old loses its tail first
    assert kv.pool.num_evictions == 1
    assert len(kv.get_computed_blocks(seq_of(list(range(100, 108)) + [5]))) == 1


def test_hash_collision_never_returns_a_wrong_block():
    kv = KVCacheManager(num_blocks=8, block_size=4, hash_fn=lambda parent, tokens, extra: b"42")
    a = seq_of([1, 2, 3, 4, 5])
    admit(kv, a)
    b = seq_of([9, 9, 9, 9, 5])  # same (stub) hash, different tokens
    assert len(kv.get_computed_blocks(b)) == 0
    admit(kv, b)
    assert b.block_table[0] != a.block_table[0]


def test_hash_chain_depends_on_the_parent():
    for algo in ("xxhash", "sha256"):
        h = BlockHasher(algo, seed=7)
        assert h(None, (1, 2)) != h(h(None, (0, 0)), (1, 2))


def test_fork_shares_blocks_and_copies_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = seq_of([1, 2, 3, 4, 5, 6])
    admit(kv, parent)
    child = seq_of([1, 2, 3, 4, 5, 6])
    kv.fork(parent, child)
    assert child.block_table == parent.block_table
    assert all(kv.pool.blocks[b].ref_cnt == 2 for b in parent.block_table)
    child.append_token(7)
    assert kv.allocate_slots(child, 1)  # writes into the shared partial block
    assert child.block_table[0] == parent.block_table[0]  # the full block stays shared
    assert child.block_table[1] != parent.block_table[1]  # the partial one was copied
    assert kv.take_blocks_to_copy() == [(parent.block_table[1], child.block_table[1])]
    kv.free(parent)
    kv.free(child)
    kv.pool.check_invariants()
    assert kv.num_free_blocks == 8


ops = st.lists(
    st.tuples(st.sampled_from(["add", "grow", "free", "abort"]), st.integers(0, 10**6)), min_size=1, max_size=60
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4, 8]), num_blocks=st.integers(4, 24))
def test_invariants_hold_under_random_operations(ops, block_size, num_blocks):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    live: list[Sequence] = []
    for op, r in ops:
        if op == "add":
            base = [r % 3] * (r % 13)  # shared prefixes are common
            s = seq_of(base + [r % 7, r % 11][: 1 + r % 2])
            if admit(kv, s):
                live.append(s)
        elif op == "grow" and live:
            s = live[r % len(live)]
            s.append_token(r % 5)
            if kv.allocate_slots(s, 1):
                s.num_computed_tokens += 1
                kv.cache_full_blocks(s, s.num_computed_tokens)
            else:
                s.token_ids.pop()
        elif op in ("free", "abort") and live:
            kv.free(live.pop(r % len(live)))
        kv.pool.check_invariants()
        held = {}
        for s in live:
            assert len(s.block_table) == -(-s.num_computed_tokens // block_size)
            for b in s.block_table:
                held[b] = held.get(b, 0) + 1
        for b in kv.pool.blocks:
            assert b.ref_cnt == held.get(b.block_id, 0)  # ref_cnt counts live holders exactly
            if b.block_hash is not None:  # only full blocks are cached, and a hit after their parent prefix finds them
                assert b.token_ids is not None and len(b.token_ids) == block_size, b
                parents = [p for p in kv.pool.blocks if p.block_hash and p.prefix_id == b.parent_prefix_id]
                if b.parent_prefix_id is None or parents:
                    assert kv.pool.lookup(b.block_hash, b.token_ids, b.extra, b.parent_prefix_id) is not None
        for s in live:  # every fully written block is findable, after the block before it
            for i in range(s.num_computed_tokens // block_size):
                parent = kv.pool.blocks[s.block_table[i - 1]].prefix_id if i else None
                tokens = tuple(s.token_ids[i * block_size : (i + 1) * block_size])
                assert kv.pool.lookup(s.block_hashes[i], tokens, b"", parent)
        for s in live:  # cached tokens are the right tokens, under the holder's chain hash
            for i, b in enumerate(s.block_table):
                blk = kv.pool.blocks[b]
                if blk.token_ids is not None:
                    assert blk.token_ids == tuple(s.token_ids[i * block_size : (i + 1) * block_size])
                    assert blk.block_hash == s.block_hashes[i]
                    assert blk.parent_prefix_id == (kv.pool.blocks[s.block_table[i - 1]].prefix_id if i else None)
    for s in live:
        kv.free(s)
    kv.pool.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
