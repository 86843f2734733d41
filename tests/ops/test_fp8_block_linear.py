"""ops/fp8_block_linear.py: per-token-group activation scales, the reference as a sum over k-groups
of dequantized block products, and the Triton block-scaled GEMM against the reference (through
Triton's interpreter on CPU at small shapes; at real shapes, with 128x128 blocks, on a GPU)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops.fp8_block_linear import (
    fp8_block_gemm,
    fp8_block_linear,
    fp8_block_linear_ref,
    quantize_groups,
    quantize_groups_triton,
)
from pagedllm.ops.fp8_linear import FP8
from tests.helpers import load_script

quantize_blocks = load_script("tools/quantize_checkpoint.py").quantize_blocks  # the test checkpoints' quantizer


def operands(m: int, n: int, k: int, block: tuple[int, int], device="cpu", dtype=torch.float32, seed=0):
    """x [m, k] with rows and groups of very different sizes; W quantized block-wise (scales that differ
    by block, so a wrong block's scale shows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    x = x * (1 + 10 * torch.rand(1, k // block[1], generator=g)).repeat_interleave(block[1], 1)
    w = torch.randn(n, k, generator=g) * (
        0.1 + torch.rand(n // block[0], k // block[1], generator=g)
    ).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    wq, ws = quantize_blocks(w, block)
    b = torch.randn(n, generator=g)
    return x.to(device, dtype), wq.to(device), ws.to(device), b.to(device, dtype)


def test_each_group_of_a_row_gets_its_own_scale_and_zero_groups_stay_zero():
    x = torch.tensor([[1.0, -2.0, 0.0, 0.0, 3e-3, 1e-3], [0.5, 0.25, 8.0, -1.0, 0.0, 0.0]])
    q, s = quantize_groups(x, 2)
    assert q.dtype == FP8 and s.shape == (2, 3)
    groups = q.float().view(2, 3, 2).abs().amax(dim=-1)
    assert groups.tolist() == [[448.0, 0.0, 448.0], [448.0, 448.0, 0.0]]
    torch.testing.assert_close(s, x.view(2, 3, 2).abs().amax(-1).clamp(min=1e-12) / 448.0)
    torch.testing.assert_close(q.float() * s.repeat_interleave(2, 1), x, rtol=0.07, atol=0)  # e4m3: 3 mantissa bits


def test_reference_is_the_sum_over_k_groups_of_the_scaled_block_products():
    m, n, k, (bn, bk) = 5, 48, 64, (16, 32)
    x, wq, ws, b = operands(m, n, k, (bn, bk))
    xq, xs = quantize_groups(x, bk)
    want = b.expand(m, n).clone()
    for g in range(k // bk):
        cols = slice(g * bk, (g + 1) * bk)
        for j in range(n // bn):
            rows = slice(j * bn, (j + 1) * bn)
            want[:, rows] += xs[:, g : g + 1] * ws[j, g] * (xq[:, cols].float() @ wq[rows, cols].float().t())
    torch.testing.assert_close(fp8_block_linear_ref(x, wq, ws, (bn, bk), b), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        fp8_block_linear(x, wq, ws, (bn, bk), b), want, rtol=1e-5, atol=1e-5
    )  # CPU: the reference
    assert fp8_block_linear_ref(x.view(1, m, k), wq, ws, (bn, bk)).shape == (1, m, n)


@pytest.mark.parametrize("m", [1, 7, 16, 33])
@pytest.mark.parametrize("n,k,block", [(64, 96, (16, 32)), (96, 64, (32, 32)), (32, 256, (32, 64))])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_the_reference(device, m, n, k, block, bias):
    """Small shapes (the interpreter on CPU): M of 1, a non-multiple of every row tile, K of several
    k-tiles and a block of two k-tiles (bk 64 with the kernel's tile at most 128: one tile here)."""
    x, wq, ws, b = operands(m, n, k, block, device, seed=m + n)
    xq, xs = quantize_groups(x, block[1])
    got = fp8_block_gemm(xq, xs, wq, ws, block, b if bias else None, torch.float32)
    want = fp8_block_linear_ref(x, wq, ws, block, b if bias else None)
    assert_close_to(got, want, device)


def assert_close_to(got: torch.Tensor, want: torch.Tensor, device: torch.device) -> None:
    """Within float32 summation order (the interpreter), or the fp8 tensor cores' accumulation (GPU),
    relative to the output's magnitude (sums of products of either sign cancel)."""
    tol = (1e-5 if device.type == "cpu" else 1e-3) * float(want.abs().amax())
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


def test_kernel_with_a_config_that_splits_the_groups(device):
    """A K tile smaller than bk (two tiles per group: the tile is at most 128) and several row and
    column tiles under a grouped program order."""
    x, wq, ws, b = operands(40, 64, 512, (32, 256), device)
    xq, xs = quantize_groups(x, 256)
    got = fp8_block_gemm(xq, xs, wq, ws, (32, 256), None, torch.float32, config=(16, 32, 2, 4, 2))
    assert_close_to(got, fp8_block_linear_ref(x, wq, ws, (32, 256)), device)


# ------------------------------------------------------------------ the GPU at real shapes

SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288)]  # (N, K): Qwen3-8B's o / gate_up / down


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 256, 2048])
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_matches_the_reference_at_real_shapes(m, n, k):
    x, wq, ws, b = operands(m, n, k, (128, 128), "cuda", torch.bfloat16, seed=m)
    got = fp8_block_linear(x, wq, ws, (128, 128), b).float()  # the kernel, bf16 out
    want = fp8_block_linear_ref(x.float(), wq, ws, (128, 128), b.float())
    scale = want.abs().amax()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3 * float(scale))  # bf16 output rounding


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4096), (37, 12288), (256, 4096)])
def test_the_group_quantizer_kernel_writes_the_torch_bytes(shape):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 20
    x[0, :128] = 0
    q, s = quantize_groups_triton(x, 128)
    q_ref, s_ref = quantize_groups(x, 128)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.gpu
def test_the_layer_replays_in_a_cuda_graph():
    x, wq, ws, _ = operands(8, 4096, 4096, (128, 128), "cuda", torch.bfloat16)
    eager = fp8_block_linear(x, wq, ws, (128, 128))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fp8_block_linear(x, wq, ws, (128, 128))  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_block_linear(x, wq, ws, (128, 128))
    x.mul_(2)
    graph.replay()
    torch.testing.assert_close(out, fp8_block_linear(x, wq, ws, (128, 128)), rtol=0, atol=0)
    assert not torch.equal(out, eager)
