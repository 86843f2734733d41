"""The copy-on-write copy kernel against its torch reference (what the CPU path runs), and the
reference against the plain per-pair copy it replaces."""

import pytest
import torch

pytest.importorskip("triton")

from pagedllm.ops.copy_blocks import copy_blocks, copy_blocks_ref  # noqa: E402


def kv_tensor(device, dtype, layers=2, blocks=9, heads=2, block_size=8, head_dim=16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, layers, blocks, heads, block_size, head_dim, generator=g).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape", [dict(), dict(layers=3, heads=1, block_size=16, head_dim=8), dict(heads=4, block_size=16, head_dim=32)]
)
def test_copy_blocks_kernel_equals_reference(device, dtype, shape):
    kv = kv_tensor(device, dtype, **shape)
    src = torch.tensor([1, 4, 4, 0], dtype=torch.int64, device=device)  # a src may be copied twice
    dst = torch.tensor([2, 5, 7, 8], dtype=torch.int64, device=device)
    want = kv.clone()
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):  # what the runner did before: one copy per pair
        want[:, :, d] = want[:, :, s]
    ref = kv.clone()
    copy_blocks_ref(ref, src, dst)
    copy_blocks(kv, src, dst)
    assert torch.equal(ref, want)
    assert torch.equal(kv, want)  # bit-exact: a copy, every layer, K and V
    untouched = [b for b in range(kv.shape[2]) if b not in dst.tolist()]
    assert torch.equal(kv[:, :, untouched], kv_tensor(device, dtype, **shape)[:, :, untouched])


def test_copy_blocks_no_pairs_is_a_no_op(device):
    kv = kv_tensor(device, torch.float32)
    before = kv.clone()
    none = torch.empty(0, dtype=torch.int64, device=device)
    copy_blocks(kv, none, none)
    copy_blocks_ref(kv, none, none)
    assert torch.equal(kv, before)
