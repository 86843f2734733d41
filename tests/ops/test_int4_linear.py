"""ops/int4_linear.py: the packed layout pinned with hand-built integers, the reference against a
per-group sum written out here, and the Triton kernel against the reference (through Triton's
interpreter on CPU at small shapes; at real shapes, group 128, on a GPU, and replayed in a CUDA graph)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops.int4_linear import (
    int4_gemm,
    int4_linear,
    int4_linear_ref,
    pack_k,
    split_k,
    unpack_k,
)


def operands(m: int, n: int, k: int, group: int, sym: bool, desc_act: bool, device="cpu", dtype=torch.float32, seed=0):
    """x [m, k] with rows of very different sizes; a packed W^T with scales that differ by group and
    column (a wrong group's scale shows), zero points 8 (symmetric) or anywhere in 0..16 (GPTQ's original
    format reaches 16), and a random input order for desc_act."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (0.1 + 4 * torch.rand(m, 1, generator=g))
    q = torch.randint(0, 16, (k, n), generator=g)
    scales = (0.002 + 0.05 * torch.rand(k // group, n, generator=g)).to(torch.float16)
    zeros = torch.full((k // group, n), 8) if sym else torch.randint(0, 17, (k // group, n), generator=g)
    perm = torch.randperm(k, generator=g).to(torch.int32) if desc_act else None
    bias = torch.randn(n, generator=g)
    return (
        x.to(device, dtype),
        pack_k(q).to(device),
        scales.to(device),
        zeros.to(device, torch.uint8),
        perm.to(device) if perm is not None else None,
        bias.to(device, dtype),
    )


def int32(nibbles: list[int]) -> int:
    v = sum(n << (4 * k) for k, n in enumerate(nibbles))
    return v - (1 << 32) if v >= 1 << 31 else v


def test_pack_k_puts_row_k_at_bits_4_k_mod_8():
    q = torch.tensor([[0, 9], [1, 10], [2, 11], [3, 12], [4, 13], [5, 14], [6, 15], [15, 8]])  # [K 8, N 2]
    packed = pack_k(q)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert packed.tolist() == [[int32([0, 1, 2, 3, 4, 5, 6, 15]), int32([9, 10, 11, 12, 13, 14, 15, 8])]]
    assert torch.equal(unpack_k(packed), q)


def test_reference_is_the_per_group_dequantized_product():
    m, n, k, group = 3, 8, 64, 16
    x, qw, s, z, perm, b = operands(m, n, k, group, sym=False, desc_act=True)
    assert perm is not None
    q = unpack_k(qw)
    want = b.expand(m, n).clone()
    for row in range(k):  # row k of W^T multiplies input column perm[k]
        w_row = (q[row].float() - z[row // group].float()) * s[row // group].float()
        want += x[:, int(perm[row])][:, None] * w_row[None, :]
    torch.testing.assert_close(int4_linear_ref(x, qw, s, z, group, perm, b), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(int4_linear(x, qw, s, z, group, perm, b), want, rtol=1e-5, atol=1e-5)  # CPU: the ref
    assert int4_linear_ref(x.view(1, m, k), qw, s, z, group).shape == (1, m, n)


def assert_close_to(got: torch.Tensor, want: torch.Tensor, device: torch.device) -> None:
    """Within float32 summation order (the interpreter), or bf16 output rounding (GPU), relative to the
    output's magnitude (sums of products of either sign cancel)."""
    tol = (1e-5 if device.type == "cpu" else 1e-2) * float(want.abs().amax())
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol)


@pytest.mark.parametrize("m", [1, 5, 16, 33])
@pytest.mark.parametrize("n,k,group", [(64, 128, 32), (48, 256, 64), (96, 256, 128)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("zeros", ["asym", "sym-desc-act"])
def test_kernel_matches_the_reference(device, m, n, k, group, bias, zeros):
    """Small shapes (the interpreter on CPU): M of 1, non-multiples of every row tile, N not a multiple
    of the column tile (48), one to eight groups; asymmetric zeros in input order, and symmetric ones
    (GPTQ sym) under a desc_act permutation."""
    sym = zeros.startswith("sym")
    x, qw, s, z, perm, b = operands(m, n, k, group, sym, desc_act=sym, device=device, seed=m + n + k)
    got = int4_gemm(x, qw, s, z, group, perm, b if bias else None)
    assert_close_to(got, int4_linear_ref(x, qw, s, z, group, perm, b if bias else None), device)


@pytest.mark.parametrize("split", [2, 3, 8])
def test_kernel_split_along_k_adds_the_same_partial_sums(device, split):
    """Several row and column tiles in grouped order, K tiles of 32 rows within groups of 64 (two per
    scale row), shared by 2, 3 (eight tiles: uneven splits) or 8 programs per output tile."""
    x, qw, s, z, perm, b = operands(40, 80, 256, 64, sym=False, desc_act=True, device=device)
    got = int4_gemm(x, qw, s, z, 64, perm, b, config=(16, 32, 32, 2, 4, 2), split=split)
    assert_close_to(got, int4_linear_ref(x, qw, s, z, 64, perm, b), device)


def test_split_k_fills_the_gpu_for_decode_and_not_for_prefill():
    assert split_k(tiles_mn=64, k_tiles=32, sms=132) == 8  # M 1, N 4096 in 64-column tiles, K 4096
    assert split_k(tiles_mn=192, k_tiles=32, sms=132) == 2  # N 12288
    assert split_k(tiles_mn=512, k_tiles=64, sms=132) == 1  # prefill: enough tiles already
    assert split_k(tiles_mn=1, k_tiles=4, sms=132) == 1  # each split keeps four K tiles
    assert split_k(tiles_mn=4, k_tiles=64, sms=1) == 1  # off CUDA: one "multiprocessor"


# ------------------------------------------------------------------ the GPU at real shapes

SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288)]  # (N, K): Qwen3-8B's o / gate_up / down


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 256, 2048])
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_matches_the_reference_at_real_shapes(m, n, k):
    sym = m == 16  # one M with GPTQ's symmetric zeros under desc_act
    x, qw, s, z, perm, b = operands(m, n, k, 128, sym, sym, "cuda", torch.bfloat16, seed=m)
    got = int4_linear(x, qw, s, z, 128, perm, b)  # the kernel, bf16 out
    want = int4_linear_ref(x.float(), qw, s, z, 128, perm, b.float())
    assert_close_to(got, want, x.device)


@pytest.mark.gpu
def test_kernel_in_float32_is_ieee():
    x, qw, s, z, perm, b = operands(16, 4096, 4096, 128, False, True, "cuda", torch.float32)
    got = int4_linear(x, qw, s, z, 128, perm, b)
    want = int4_linear_ref(x.cpu(), qw.cpu(), s.cpu(), z.cpu(), 128, perm.cpu() if perm is not None else None, b.cpu())
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-4 * float(want.abs().amax()))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 256])  # split-K (partials and their sum) and one program per tile
def test_the_layer_replays_in_a_cuda_graph(m):
    x, qw, s, z, perm, b = operands(m, 4096, 4096, 128, False, True, "cuda", torch.bfloat16)
    eager = int4_linear(x, qw, s, z, 128, perm, b)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        int4_linear(x, qw, s, z, 128, perm, b)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_linear(x, qw, s, z, 128, perm, b)
    x.mul_(2)
    graph.replay()
    torch.testing.assert_close(out, int4_linear(x, qw, s, z, 128, perm, b), rtol=0, atol=0)
    assert not torch.equal(out, eager)
