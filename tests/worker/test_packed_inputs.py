"""The decode graphs' input buffers (worker/staging.py PackedInputs, used by worker/cuda_graphs.py):
typed views of one device buffer at fixed addresses, filled from two host sets in turn, a step
of B rows copying every 1-D buffer and each table's first B rows. Checked on CPU tensors (the
same copies, without pinning or events); the decode graphs replay them on CUDA (tests/gpu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.worker.staging import PackedInputs

MAX_BS, BLOCKS = 8, 5


def packed(groups: int = 1) -> PackedInputs:
    layout = [
        ("input_ids", torch.int64, (MAX_BS,)),
        ("seq_lens", torch.int32, (MAX_BS,)),
        *((f"block_tables{g or ''}", torch.int32, (MAX_BS, BLOCKS)) for g in range(groups)),
    ]
    return PackedInputs(layout, torch.device("cpu"))


def test_views_are_typed_shaped_and_keep_their_addresses():
    p = packed(groups=2)
    assert p.dev["input_ids"].dtype == torch.int64 and p.dev["input_ids"].shape == (MAX_BS,)
    assert p.dev["block_tables1"].dtype == torch.int32 and p.dev["block_tables1"].shape == (MAX_BS, BLOCKS)
    addresses = {name: t.data_ptr() for name, t in p.dev.items()}
    assert all(a % 16 == 0 for a in addresses.values()), "every view starts aligned"
    for _ in range(3):  # a graph captured on these views reads each step's values
        h = p.next_host()
        h["input_ids"][:2] = [1, 2]
        p.upload(2)
    assert {name: t.data_ptr() for name, t in p.dev.items()} == addresses


@pytest.mark.parametrize("groups", [1, 2])
def test_a_step_copies_its_rows_and_leaves_the_tables_other_rows(groups):
    p = packed(groups)
    first = p.next_host()
    for name in first:
        first[name][...] = 7  # a step of all the rows
    p.upload(MAX_BS)
    h = p.next_host()
    assert h is not first, "the other host set: the first may still be copying"
    h["input_ids"][:3] = [10, 11, 12]
    h["input_ids"][3:] = 0
    h["seq_lens"][:] = [4, 5, 6, 1, 1, 1, 1, 1]
    for g in range(groups):
        h[f"block_tables{g or ''}"][:3] = np.arange(3 * BLOCKS).reshape(3, BLOCKS) + 100 * g
    p.upload(3)
    assert p.dev["input_ids"].tolist() == [10, 11, 12, 0, 0, 0, 0, 0]
    assert p.dev["seq_lens"].tolist() == [4, 5, 6, 1, 1, 1, 1, 1]
    for g in range(groups):
        tables = p.dev[f"block_tables{g or ''}"]
        assert torch.equal(tables[:3], torch.arange(3 * BLOCKS, dtype=torch.int32).view(3, BLOCKS) + 100 * g)
        assert (tables[3:] == 7).all(), "rows past the step's are not copied (the graph never reads them)"


@pytest.mark.parametrize("with_table", [False, True])
def test_entries_copies_only_the_front_of_each_flat_buffer(with_table):
    """A prefill graph's token buffers are sized for its largest step: `entries` sends only the
    front of each, never past a shorter buffer's end, and the table's first rows as usual."""
    layout = [("input_ids", torch.int64, (MAX_BS,)), ("seq_lens", torch.int32, (3,))]
    layout += [("block_tables", torch.int32, (MAX_BS, BLOCKS))] if with_table else []
    p = PackedInputs(layout, torch.device("cpu"))
    h = p.next_host()
    h["input_ids"][:] = np.arange(MAX_BS) + 1
    h["seq_lens"][:] = [5, 6, 7]
    if with_table:
        h["block_tables"][:] = 9
    p.upload(2, entries=5)
    assert p.dev["input_ids"].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert p.dev["seq_lens"].tolist() == [5, 6, 7], "a buffer shorter than `entries` goes up whole, no further"
    if with_table:
        assert (p.dev["block_tables"][:2] == 9).all() and (p.dev["block_tables"][2:] == 0).all()


def test_tables_must_follow_the_flat_buffers():
    with pytest.raises(AssertionError, match="1-D buffers first"):
        PackedInputs([("t", torch.int32, (2, 2)), ("ids", torch.int64, (2,))], torch.device("cpu"))
