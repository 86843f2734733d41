"""A pool's cost does not grow with its size: blocks are made when first allocated, and the ones
never used are the head of the LRU free queue (issue 29: a tiny model's default pool on an H200 is
16 million blocks, and building them all took most of a 36 s start-up)."""

from pagedllm.engine.block_pool import BlockPool


def test_a_huge_pool_starts_empty_and_hands_out_ids_in_lru_order():
    pool = BlockPool(50_000_000)
    assert pool.num_free_blocks == 50_000_000
    assert len(pool.blocks) == 0  # nothing made yet (a list of 50M blocks would be gigabytes)
    a, b, c = (pool.allocate() for _ in range(3))
    assert [a.block_id, b.block_id, c.block_id] == [0, 1, 2]
    pool.release(b)
    # the never-used blocks were free before b: they come first (LRU), then b
    assert pool.allocate().block_id == 3
    assert pool.num_free_blocks == 50_000_000 - 3
    pool.check_invariants()


def test_a_pool_used_to_the_last_block_then_freed_reuses_in_lru_order():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(4)]
    assert pool.num_free_blocks == 0
    for blk in (blocks[2], blocks[0], blocks[3], blocks[1]):
        pool.release(blk)
    assert [pool.allocate().block_id for _ in range(4)] == [2, 0, 3, 1]
    pool.check_invariants()
