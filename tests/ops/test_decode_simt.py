"""The SIMT decode-attention experiment (ops/decode_simt.py) against the reference: GQA groups,
16-bit and fp8 caches, splits, a padding row, launch order, sliding window and soft cap."""

import pytest
import torch

pytest.importorskip("triton")

from pagedllm.ops.attention_metadata import longest_first  # noqa: E402
from pagedllm.ops.attention_ref import paged_attention_ref  # noqa: E402
from pagedllm.ops.decode_simt import decode_attention_simt  # noqa: E402


def make(lens, group, kv_dtype, device, hkv=2, d=32, bs=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = [-(-n // bs) for n in lens]
    num_blocks = sum(nb) + 1
    k = torch.randn(num_blocks, hkv, bs, d, generator=g) / 2
    v = torch.randn(num_blocks, hkv, bs, d, generator=g) / 2
    bt = torch.zeros(len(lens), max(max(nb), 1), dtype=torch.int32)
    perm, used = torch.randperm(num_blocks, generator=g).int(), 0
    for i, n in enumerate(nb):
        bt[i, :n] = perm[used : used + n]
        used += n
    q = torch.randn(len(lens), hkv * group, d, generator=g)
    dt = torch.bfloat16 if kv_dtype == torch.float8_e4m3fn else kv_dtype
    return dict(
        q=q.to(dt).to(device),
        k_cache=k.to(kv_dtype).to(device),
        v_cache=v.to(kv_dtype).to(device),
        block_tables=bt.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
    )


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("group,splits", [(1, 1), (2, 3), (4, 2), (3, 1)])
def test_simt_decode_matches_reference(kv_dtype, group, splits, device):
    c = make([70, 0, 129, 5, 16], group, kv_dtype, device, seed=group * 7 + splits)
    kw = dict(scale=32**-0.5, k_scale=0.5, v_scale=2.0) if kv_dtype == torch.float8_e4m3fn else dict(scale=32**-0.5)
    cu = torch.arange(6, dtype=torch.int32, device=device)
    ref = paged_attention_ref(**c, cu_seqlens_q=cu, **kw)
    out = decode_attention_simt(**c, num_splits=splits, **kw)
    tol = 1e-4 if kv_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert out[1].abs().max() == 0  # the padding row (no keys)
    order = torch.from_numpy(longest_first(c["seq_lens"].cpu().numpy())).to(device)
    assert torch.equal(decode_attention_simt(**c, num_splits=splits, seq_order=order, **kw), out)


@pytest.mark.parametrize("window,cap", [(6, None), (None, 0.5), (20, 2.0)])
def test_simt_decode_window_and_soft_cap(window, cap, device):
    c = make([70, 3, 129], 2, torch.float32, device, seed=3)
    cu = torch.arange(4, dtype=torch.int32, device=device)
    kw = dict(scale=32**-0.5, sliding_window=window, logits_soft_cap=cap)
    ref = paged_attention_ref(**c, cu_seqlens_q=cu, **kw)
    for splits in (1, 2):
        out = decode_attention_simt(**c, num_splits=splits, block_n=16, **kw)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
