"""BlockTableRows (worker/step_inputs.py) across steps: every call equals a table built afresh, when
the same sequences come back in the same order (rows patched), when a row grows past the width,
shrinks, or when the batch changes."""

import numpy as np

from pagedllm.worker.step_inputs import BlockTableRows


class Seq:
    def __init__(self, seq_id, tables):
        self.seq_id, self.block_tables, self.block_tables_version = seq_id, tables, 0

    def set(self, tables):
        self.block_tables = tables
        self.block_tables_version += 1


class Sched:
    def __init__(self, seq):
        self.seq = seq


def fresh(seqs, groups):
    return BlockTableRows().tables([Sched(s) for s in seqs], groups)


def check(rows, seqs, groups):
    got = rows.tables([Sched(s) for s in seqs], groups)
    want = fresh(seqs, groups)
    assert got.shape[:2] == want.shape[:2] and got.shape[2] >= want.shape[2]
    assert np.array_equal(got[:, :, : want.shape[2]], want) and not got[:, :, want.shape[2] :].any()
    return got


def test_rows_patched_across_steps_equal_a_fresh_build():
    a, b, c = Seq(1, [[5, 6, 7]]), Seq(2, [[9]]), Seq(3, [[1, 2]])
    rows = BlockTableRows()
    first = check(rows, [a, b, c], 1)
    first[:] = 99  # the caller's copy: writing to it must not reach the next step's tables
    check(rows, [a, b, c], 1)  # unchanged
    b.set([[9, 4]])  # grows within the width: patched
    check(rows, [a, b, c], 1)
    a.set([[5]])  # shrinks (a rollback): the rest of its row is zeroed
    check(rows, [a, b, c], 1)
    c.set([[1, 2, 3, 8, 11]])  # outgrows the width: rebuilt wider
    assert check(rows, [a, b, c], 1).shape[2] == 5
    check(rows, [c, a], 1)  # another batch: rebuilt, the dropped sequence forgotten
    assert set(rows.rows) == {1, 3}
    check(rows, [c, a], 1)


def test_null_blocks_and_several_groups():
    a, b = Seq(1, [[-1, 4], [3, 5]]), Seq(2, [[7], [8]])  # NULL_BLOCK (-1) reads as block 0
    rows = BlockTableRows()
    assert check(rows, [a, b], 2)[0, 0, 0] == 0
    b.set([[-1, 2], [8, 6]])
    check(rows, [a, b], 2)
