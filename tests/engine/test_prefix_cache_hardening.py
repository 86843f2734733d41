"""A prefix cache that cannot be poisoned: hits verified along the whole parent chain, a secret
per-pool hash seed (xxh64) or sha256, and cache_salt so that tenants share only KV they both
computed (block_pool.py, kv_cache_manager.py)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.engine import KVCacheManager, LLMEngine, SamplingParams, SchedulerConfig, Sequence
from pagedllm.engine.block_pool import BlockHasher
from tests.engine.fake_runner import ShadowRunner, drain, reference_generate
from tests.engine.test_block_pool import admit

BS = 4


def seq_of(tokens, rid="r", salt=None):
    return Sequence(rid, tokens, SamplingParams(cache_salt=salt))


def chain_length_hash(parent, tokens, extra):
    """A crafted collision: the hash of block i depends on i only, so every prefix of the same
    length has the same chain of hashes (what an attacker who can compute the hash aims for)."""
    return (parent or b"") + b"."


P_A, P_B, X, Y = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9], [3, 3, 3, 3]


def test_a_colliding_chain_never_hits_blocks_computed_after_another_prefix():
    kv = KVCacheManager(num_blocks=32, block_size=BS, hash_fn=chain_length_hash)
    a = seq_of(P_A + X + [0], "a")  # the victim: X computed after P_A
    c = seq_of(P_B + Y + [0], "c")  # makes P_B's first block findable
    assert admit(kv, a) and admit(kv, c)
    assert c.num_cached_tokens == 0  # same hash as a's first block, other tokens: a miss
    b = seq_of(P_B + X + [0], "b")  # the attacker: last blocks equal a's, hashes equal a's
    hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hit.blocks[0]] == [c.block_table[0]]  # P_B only: a's X was computed after P_A
    assert admit(kv, b)
    assert b.num_cached_tokens == BS and b.block_table[1] != a.block_table[1]

    # genuine hits still work, and pick the verified block among several under one hash
    d = seq_of(P_B + X + [7], "d")
    assert admit(kv, d)
    assert d.num_cached_tokens == 2 * BS and d.block_table[:2] == b.block_table[:2]
    e = seq_of(P_A + X + [7], "e")
    assert admit(kv, e)
    assert e.num_cached_tokens == 2 * BS and e.block_table[:2] == a.block_table[:2]
    kv.pool.check_invariants()
    for s in (a, b, c, d, e):
        kv.free(s)
    assert kv.num_free_blocks == kv.num_blocks


def test_duplicate_prefixes_serve_each_other():
    """Two sequences computed the same prefix at the same time (neither could hit the other):
    their blocks are interchangeable, so a later hit may continue on the second copy where the
    first one's tail was evicted."""
    kv = KVCacheManager(num_blocks=8, block_size=BS, hash_fn=chain_length_hash)
    prompt = P_A + X + Y
    a, b = seq_of(prompt + [0], "a"), seq_of(prompt + [1], "b")
    for s in (a, b):  # admitted in one step: both miss
        assert len(kv.get_computed_blocks(s)) == 0 and kv.allocate_slots(s, s.num_tokens)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        kv.cache_full_blocks(s, s.num_tokens)
    table_a, table_b = a.block_table, b.block_table
    kv.free(a)
    kv.free(b)  # free queue: a's 4 blocks tail-first, then b's
    filler = seq_of([42] * 5, "f")
    assert admit(kv, filler)  # takes a's partial block and a's third block
    assert filler.block_table == [table_a[3], table_a[2]]
    c = seq_of(prompt + [2], "c")
    hit = kv.get_computed_blocks(c)
    assert [blk.block_id for blk in hit.blocks[0]] == table_a[:2] + table_b[2:3]  # b's copy continues a's chain
    assert admit(kv, c) and c.num_cached_tokens == 3 * BS
    kv.pool.check_invariants()


@pytest.mark.parametrize("algo,size", [("xxhash", 8), ("sha256", 32)])
def test_hash_algos_and_seeds(algo, size):
    tokens = (1, 2, 3, 4)
    h = BlockHasher(algo, seed=123)
    assert h(None, tokens) == BlockHasher(algo, seed=123)(None, tokens)  # a fixed seed is reproducible
    assert len(h(None, tokens)) == size and isinstance(h(None, tokens), bytes)
    assert h(None, tokens) != BlockHasher(algo, seed=124)(None, tokens)
    assert h(None, tokens, b"salt") != h(None, tokens)
    # the default seed is drawn per pool, in the same process: hashes cannot be precomputed
    hashes = []
    for _ in range(2):
        kv = KVCacheManager(num_blocks=8, block_size=BS, hash_algo=algo)
        s = seq_of(P_A + X + [0])
        assert admit(kv, s)
        assert [len(x) for x in s.block_hashes] == [size, size]
        hashes.append(s.block_hashes)
        t = seq_of(P_A + X + [1])
        assert admit(kv, t) and t.num_cached_tokens == 2 * BS  # genuine hits under either algo
    assert hashes[0] != hashes[1]


def test_engine_core_uses_the_configured_hash_algo():
    for algo, size in (("xxhash", 8), ("sha256", 32)):
        cfg = SchedulerConfig(num_kv_blocks=16, block_size=BS, max_model_len=64, prefix_caching_hash_algo=algo)
        engine = LLMEngine(cfg, ShadowRunner(BS))
        for rid, last in (("a", 0), ("b", 1)):
            engine.add_request(rid, P_A + X + [last], SamplingParams(max_tokens=2, ignore_eos=True))
            outs = drain(engine)
        assert outs["b"].num_cached_tokens == 2 * BS
        assert outs["b"].outputs[0].token_ids == reference_generate(P_A + X + [1], 2)
        assert {len(h) for _, h in engine.kv.pool.cached} == {size}


def test_cache_salt_separates_tenants():
    """Requests share KV only under equal salts (or both without one); the salt is checked on a
    hit like the tokens, not only hashed."""
    engine = LLMEngine(SchedulerConfig(num_kv_blocks=64, block_size=BS, max_model_len=64), ShadowRunner(BS))
    prompt = P_A + X + Y + [0]
    cached = {}
    for rid, salt in [("t1", "tenant-1"), ("t2", "tenant-2"), ("none", None), ("t1-again", "tenant-1"),
                      ("t2-again", "tenant-2"), ("none-again", None), ("t1-prefix", "tenant-1x")]:  # fmt: skip
        engine.add_request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True, cache_salt=salt))
        out = drain(engine)[rid]
        assert out.outputs[0].token_ids == reference_generate(prompt, 2)
        cached[rid] = out.num_cached_tokens
    assert cached == {
        "t1": 0,
        "t2": 0,
        "none": 0,
        "t1-again": 3 * BS,
        "t2-again": 3 * BS,
        "none-again": 3 * BS,
        "t1-prefix": 0,
    }
    engine.kv.pool.check_invariants()


def test_cache_salt_is_verified_not_only_hashed():
    """Under a hash that ignores the salt, a hit still needs the same salt."""
    kv = KVCacheManager(num_blocks=16, block_size=BS, hash_fn=chain_length_hash)
    a = seq_of(P_A + X + [0], "a", salt="alice")
    assert admit(kv, a)
    for rid, salt, expect in [("m", "mallory", 0), ("n", None, 0), ("a2", "alice", 2 * BS)]:
        s = seq_of(P_A + X + [1], rid, salt=salt)
        assert admit(kv, s)
        assert s.num_cached_tokens == expect, rid


ops = st.lists(
    st.tuples(st.sampled_from(["add", "add", "grow", "free"]), st.integers(0, 10**6)), min_size=1, max_size=50
)


@settings(max_examples=120, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(4, 20))
def test_no_hit_ever_serves_another_prefix_under_total_collision(ops, block_size, num_blocks):
    """Every chain of one length has one hash (the worst an attacker could craft), tokens from a
    tiny alphabet, three tenants: whatever happens, each block a sequence holds carries KV of
    that sequence's own prefix under its own salt (tracked here as the test's shadow KV)."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, hash_fn=chain_length_hash)
    shadow: dict[int, tuple] = {}  # block id -> (salt, tokens) its KV was computed from
    live: list[Sequence] = []

    def prefix(s, i):
        return (s.sampling_params.cache_salt, tuple(s.token_ids[: (i + 1) * block_size]))

    def write(s, start):  # blocks that s's own tokens completed, from block `start`
        for i in range(start, s.num_computed_tokens // block_size):
            shadow[s.block_table[i]] = prefix(s, i)

    for op, r in ops:
        if op == "add":
            s = Sequence(str(r), [(r >> k) % 2 for k in range(r % 11)] + [r % 3], SamplingParams(
                cache_salt=[None, "a", "b"][r % 3]))  # fmt: skip
            hit = kv.get_computed_blocks(s)
            if admit(kv, s):
                write(s, len(hit))
                live.append(s)
        elif op == "grow" and live:
            s = live[r % len(live)]
            s.append_token(r % 2)
            if kv.allocate_slots(s, 1):
                s.num_computed_tokens += 1
                kv.cache_full_blocks(s, s.num_computed_tokens)
                write(s, (s.num_computed_tokens - 1) // block_size)
            else:
                s.token_ids.pop()
        elif op == "free" and live:
            kv.free(live.pop(r % len(live)))
        kv.pool.check_invariants()
        for s in live:
            for i in range(s.num_computed_tokens // block_size):
                assert shadow[s.block_table[i]] == prefix(s, i), (s, i)
    for s in live:
        kv.free(s)
    assert kv.num_free_blocks == kv.num_blocks
