"""The batched decode reference equals the general (looped) reference."""

import pytest
import torch

from pagedllm.ops.attention_ref import paged_attention_ref, paged_decode_attention_ref


@pytest.mark.parametrize("block_size,group", [(4, 1), (8, 2), (16, 4)])
def test_batched_decode_reference_matches_looped(block_size, group):
    torch.manual_seed(0)
    hkv, d, num_blocks = 2, 16, 128
    seq_lens = torch.tensor([1, 7, 33, 20, 64], dtype=torch.int32)
    b = len(seq_lens)
    k_cache = torch.randn(num_blocks, hkv, block_size, d)
    v_cache = torch.randn(num_blocks, hkv, block_size, d)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    tables = torch.randperm(num_blocks)[: b * max_blocks].view(b, max_blocks).int()
    q = torch.randn(b, hkv * group, d)
    cu = torch.arange(b + 1, dtype=torch.int32)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, cu, seq_lens, 0.25)
    got = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, int(seq_lens.max()), 0.25)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # a wrong length must show: the mask matters
    shorter = (seq_lens - 1).clamp(min=1)
    wrong = paged_decode_attention_ref(q, k_cache, v_cache, tables, shorter, int(seq_lens.max()), 0.25)
    assert not torch.allclose(wrong, ref, atol=1e-4)
