"""The fused MoE kernel (ops/fused_moe.py) against its torch reference (ops/moe_ref.py): on CPU
through Triton's interpreter at small shapes, on a GPU at Qwen3-30B-A3B's and Mixtral's expert
shapes (gpu-marked). Routings include experts that receive no token and one expert that receives
every token."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops import fused_moe as kernels
from pagedllm.ops.fused_moe import fused_moe, moe_align_block_size
from pagedllm.ops.moe_ref import fused_moe_ref, moe_align_block_size_ref, padded_size, select_experts

SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)


def weights(e: int, h: int, i: int, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype).to(device)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype).to(device)
    return w13, w2


def routing(kind: str, t: int, e: int, k: int, device, seed=1):
    """(weights [T, k] float32, ids [T, k] int32): "random" from a random router; "hot": expert 0
    is every token's first choice and experts past 2k are never chosen."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    if kind == "hot":
        logits[:, 2 * k :] -= 30.0
        logits[:, 0] += 10.0
    w, ids = select_experts(logits, k, renormalize=True)
    return w.to(device), ids.to(device)


@pytest.mark.parametrize(
    ("e", "k", "renormalize", "dtype"),
    [(8, 2, True, torch.float32), (128, 8, False, torch.bfloat16), (60, 3, True, torch.bfloat16)],
)
def test_router_kernel_matches_the_reference(device, e, k, renormalize, dtype):
    """Softmax, top-k, renormalisation and the rounding of HF's Qwen3-MoE (bf16), E not a power of 2.
    Each row's logits are distinct multiples of 1/16 (exact in bf16: no ties for top-k to break)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.stack([(torch.randperm(e, generator=g) - e / 2) / 16 for _ in range(7)]).to(dtype).to(device)
    want_w, want_ids = select_experts(logits.cpu(), k, renormalize, round_weights=True)
    got_w, got_ids = kernels.select_experts(logits, k, renormalize, round_weights=True)
    assert got_ids.cpu().tolist() == want_ids.tolist()
    # bf16: within one rounding step (Triton's interpreter truncates to bf16, seen with triton 3.9)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(got_w.cpu(), want_w, **tol)


def test_align_groups_pairs_by_expert_padded_to_the_block(device):
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], dtype=torch.int32)  # expert 1 empty
    sorted_ids, expert_ids, num_padded = moe_align_block_size_ref(ids, 4, 4)
    assert sorted_ids.numel() == padded_size(6, 4, 4) == 20  # 6 pairs + 4 experts * 3, rounded up
    n = 6  # the sentinel
    assert int(num_padded) == 12
    assert sorted_ids[:12].tolist() == [1, 4, n, n, 0, 2, 5, n, 3, n, n, n]
    assert expert_ids[:3].tolist() == [0, 2, 3]
    got = moe_align_block_size(ids.to(device), 4, 4)
    assert int(got[2]) == 12 and got[0][:12].tolist() == sorted_ids[:12].tolist()
    assert got[1][:3].tolist() == [0, 2, 3]


@pytest.mark.parametrize(("t", "k", "e", "block_m"), [(1, 8, 32, 16), (300, 2, 8, 16), (64, 4, 16, 64)])
def test_align_kernel_matches_its_reference(device, t, k, e, block_m):
    """Several chunks of pairs per program (256 each), empty experts, a block wider than a run."""
    _, ids = routing("hot" if t == 64 else "random", t, e, k, device)
    want = moe_align_block_size_ref(ids.cpu(), e, block_m)
    got = moe_align_block_size(ids, e, block_m)
    used = int(want[2])
    assert int(got[2]) == used
    assert got[0][:used].tolist() == want[0][:used].tolist()
    assert got[1][: used // block_m].tolist() == want[1][: used // block_m].tolist()


@pytest.mark.parametrize(("t", "k", "kind"), [(1, 2, "random"), (5, 3, "hot"), (37, 2, "random"), (37, 2, "hot")])
def test_fused_moe_matches_the_reference(device, t, k, kind):
    e, h, i = 8, 32, 48  # i not a multiple of BLOCK_N: the column masks are exercised
    w13, w2 = weights(e, h, i, torch.float32, device)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(2)).to(device)
    w, ids = routing(kind, t, e, k, device)
    if kind == "hot":
        assert (ids[:, 0] == 0).all() and not torch.isin(ids, torch.arange(2 * k, e, device=device)).any()
    got = fused_moe(x, w13, w2, w, ids, config=SMALL)
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, w, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("entry", range(len(kernels.MOE_CONFIGS)))
def test_every_tuned_block_config_matches_the_reference(device, entry):
    """Each row of MOE_CONFIGS (the H200 sweep's choices), at a shape smaller than its tiles:
    the row, column and K masks of every tile size the engine can pick."""
    cfg = kernels.MOE_CONFIGS[entry][1]
    e, h, i, t = 4, 80, 72, 19
    w13, w2 = weights(e, h, i, torch.float32, device)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(6)).to(device)
    w, ids = routing("random", t, e, 2, device)
    got = fused_moe(x, w13, w2, w, ids, config=cfg)
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, w, ids), rtol=1e-4, atol=1e-4)


def test_bf16_matches_the_reference_within_rounding(device):
    w13, w2 = weights(4, 32, 32, torch.bfloat16, device)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(device)
    w, ids = routing("random", 9, 4, 2, device)
    got = fused_moe(x, w13, w2, w, ids, config=SMALL)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), fused_moe_ref(x, w13, w2, w, ids).float(), rtol=3e-2, atol=3e-2)


SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b": (8, 4096, 14336, 2)}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("t", [1, 7, 64, 256, 2048])
def test_real_shapes_on_gpu(shape, t):
    e, h, i, k = SHAPES[shape]
    dev = torch.device("cuda")
    w13, w2 = weights(e, h, i, torch.bfloat16, dev)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    for kind in ("random", "hot"):
        w, ids = routing(kind, t, e, k, dev)
        want = fused_moe_ref(x, w13, w2, w, ids).float()
        got = fused_moe(x, w13, w2, w, ids).float()
        err = (got - want).abs().max() / want.abs().max()
        assert err < 2e-2, (shape, t, kind, float(err))


@pytest.mark.gpu
def test_captured_in_a_cuda_graph():
    """No host synchronisation: the call captures, and replays with new routings give new results."""
    e, h, i, k = SHAPES["qwen3-30b-a3b"]
    dev = torch.device("cuda")
    w13, w2 = weights(e, h, i, torch.bfloat16, dev)
    x = torch.randn(16, h, device=dev, dtype=torch.bfloat16)
    w, ids = routing("random", 16, e, k, dev)
    fused_moe(x, w13, w2, w, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, w, ids)
    for seed in (5, 6):
        w2_, ids2 = routing("random", 16, e, k, dev, seed=seed)
        w.copy_(w2_)
        ids.copy_(ids2)
        graph.replay()
        want = fused_moe_ref(x, w13, w2, w, ids).float()
        assert (out.float() - want).abs().max() / want.abs().max() < 2e-2
