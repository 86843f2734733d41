"""ops/decode_gemm.py: the Triton kernel against the float32 reference (through Triton's interpreter on
CPU at small shapes; at a model's shapes on a GPU, and replayed in a CUDA graph), its split-K sums in a
fixed order, and which products `linear` sends to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.ops import decode_gemm as dg
from pagedllm.ops.decode_gemm import (
    decode_gemm,
    decode_gemm_config,
    decode_gemm_ref,
    linear,
    split_count,
    tile_counters,
)


def operands(m: int, n: int, k: int, device, dtype=torch.float32, seed=0):
    """x [m, k] with rows of very different sizes, W [n, k] and a bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (0.1 + 4 * torch.rand(m, 1, generator=g))
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    return x.to(device, dtype), w.to(device, dtype), b.to(device, dtype)


def assert_close_to(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within float32 summation order (float32 out), or one rounding of a bf16 / fp16 output."""
    tol = (1e-5 if got.dtype == torch.float32 else 1e-2) * float(want.float().abs().amax())
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol)


def test_reference_is_the_float32_product_rounded_once():
    x, w, b = operands(3, 5, 7, "cpu", torch.bfloat16)
    want = (x.double() @ w.double().t() + b.double()).to(torch.bfloat16)
    torch.testing.assert_close(decode_gemm_ref(x, w, b), want, rtol=0, atol=0.02)
    assert decode_gemm_ref(x, w).dtype == torch.bfloat16


@pytest.mark.parametrize("m", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("n,k", [(64, 128), (48, 96), (80, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_the_reference(device, m, n, k, bias):
    """Small shapes (the interpreter on CPU): M of 1, rows past one and two row tiles, N not a
    multiple of the column tile (48, 80), K not a multiple of the K tile (96, 200), one split."""
    x, w, b = operands(m, n, k, device, seed=m + n + k)
    got = decode_gemm(x, w, b if bias else None, config=(16, 32, 64, 1, 4, 2))
    assert_close_to(got, decode_gemm_ref(x, w, b if bias else None))


@pytest.mark.parametrize("split", [2, 3, 4])
@pytest.mark.parametrize("k", [256, 200])
def test_kernel_split_along_k_adds_every_partial_sum_once(device, split, k):
    """K tiles of 32 shared by 2, 3 (uneven) or 4 programs per output tile, with K a multiple of the
    tile and not (the last split's tail masked), bias added once, after the partial sums."""
    x, w, b = operands(20, 48, k, device, seed=split)
    got = decode_gemm(x, w, b, config=(16, 16, 32, split, 4, 2))
    assert_close_to(got, decode_gemm_ref(x, w, b))


@pytest.mark.parametrize("split", [2, 3, 4])
def test_the_last_split_to_arrive_adds_the_partials_and_zeroes_its_count(device, split):
    """With counters, no second kernel: the partial sums are added in the same order as the split-K
    sum kernel's (the same bits), several row and column tiles each count their own splits, and every
    count is zero again afterwards (the next call, e.g. the next replay of a graph, starts clean)."""
    x, w, b = operands(20, 48, 200, device, seed=10 + split)
    counters = tile_counters(48, device)
    config = (16, 16, 32, split, 4, 2)
    here = decode_gemm(x[:16], w, b, config=config, counters=counters)
    assert torch.equal(here, decode_gemm(x[:16], w, b, config=config))  # the two-kernel path's bits
    assert_close_to(here, decode_gemm_ref(x[:16], w, b))
    assert int(counters.abs().sum()) == 0
    again = decode_gemm(x[:16], w, b, config=config, counters=counters)
    assert torch.equal(again, here) and int(counters.abs().sum()) == 0


def test_too_few_counters_are_refused(device):
    x, w, _ = operands(3, 64, 128, device)
    with pytest.raises(AssertionError, match="counters for"):
        decode_gemm(x, w, config=(16, 16, 32, 2, 4, 2), counters=torch.zeros(2, dtype=torch.int32, device=device))


def test_bf16_output_is_rounded_once(device):
    """bf16 operands: the dot's float32 sum rounded once to bf16 (on the interpreter, an IEEE dot)."""
    x, w, b = operands(4, 64, 256, device, torch.bfloat16, seed=3)
    got = decode_gemm(x, w, b, config=(16, 32, 64, 2, 4, 2))
    assert got.dtype == torch.bfloat16
    assert_close_to(got, decode_gemm_ref(x, w, b))


def test_no_rows_gives_an_empty_output(device):
    x, w, _ = operands(0, 32, 64, device)
    assert decode_gemm(x, w).shape == (0, 32)


def test_split_fills_the_gpu_only_where_k_is_long_enough():
    assert split_count(tiles=32, k=2048, block_k=128, sms=132) == 4  # N 1024 in 32-row tiles: 128 programs
    assert split_count(tiles=64, k=1024, block_k=128, sms=132) == 2
    assert split_count(tiles=128, k=1024, block_k=128, sms=132) == 1  # one wave already
    assert split_count(tiles=32, k=256, block_k=128, sms=132) == 1  # each split keeps two K tiles
    assert split_count(tiles=4, k=4096, block_k=128, sms=1) == 1  # off CUDA: one "multiprocessor"


def test_config_is_the_sweeps_best_at_qwen3_0_6b_shapes():
    """benchmarks/results/decode-gemm/decode-gemm-sweep-h200-13d95d7.json, 1-16 rows, 132 SMs."""
    assert decode_gemm_config(1, 4096, 1024, 132) == (16, 32, 128, 1, 4, 4)  # qkv
    assert decode_gemm_config(4, 1024, 2048, 132) == (16, 32, 128, 4, 4, 4)  # o
    assert decode_gemm_config(16, 6144, 1024, 132) == (16, 64, 256, 1, 4, 4)  # gate_up
    assert decode_gemm_config(1, 1024, 3072, 132) == (16, 32, 128, 4, 4, 4)  # down
    assert decode_gemm_config(32, 4096, 1024, 132)[0] == 32
    assert decode_gemm_config(64, 4096, 1024, 132)[0] == 64


def test_a_linear_layer_owns_counters_for_its_output_rows():
    from pagedllm.model.linear import ColumnParallelLinear, RowParallelLinear

    col, row = ColumnParallelLinear(64, 96), RowParallelLinear(96, 40)
    assert col.tile_counters.shape == (6,) and row.tile_counters.shape == (3,)  # 16-column tiles
    assert col.tile_counters.dtype == torch.int32 and "tile_counters" not in col.state_dict()


def test_linear_keeps_f_linear_off_cuda_and_for_float32():
    """On CPU (and for float32 anywhere) `linear` is F.linear itself: the same bits."""
    x, w, b = operands(3, 16, 32, "cpu", torch.bfloat16)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert not dg.wanted(x, w)


def test_the_switch_refuses_an_unknown_value(monkeypatch):
    from pagedllm import envs

    monkeypatch.setenv("PAGEDLLM_DECODE_GEMM", "cutlass")
    with pytest.raises(ValueError, match="PAGEDLLM_DECODE_GEMM"):
        envs.decode_gemm()
    monkeypatch.setenv("PAGEDLLM_DECODE_GEMM", "cublas")
    assert envs.decode_gemm() == "cublas"


# ------------------------------------------------------------------ the GPU at a model's shapes

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (4096, 4096)]  # Qwen3-0.6B's four, an 8B's o


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_the_reference_at_real_shapes(m, n, k, dtype):
    x, w, b = operands(m, n, k, "cuda", dtype, seed=m + n)
    got = linear(x, w, b, tile_counters(n, "cuda"))  # the kernel: few rows, bf16 / fp16
    assert dg.wanted(x, w)
    assert_close_to(got, decode_gemm_ref(x, w, b))
    assert_close_to(got, F.linear(x, w, b))  # cuBLAS: the same within one rounding


@pytest.mark.gpu
def test_linear_takes_cublas_past_the_row_limit_and_when_switched_off(monkeypatch):
    x, w, b = operands(dg.MAX_ROWS + 1, 1024, 1024, "cuda", torch.bfloat16)
    assert not dg.wanted(x, w) and torch.equal(linear(x, w, b), F.linear(x, w, b))
    x = x[:4]
    assert dg.wanted(x, w)
    monkeypatch.setenv("PAGEDLLM_DECODE_GEMM", "cublas")
    assert not dg.wanted(x, w) and torch.equal(linear(x, w, b), F.linear(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16])  # split-K, summed in the kernel and by the second kernel
@pytest.mark.parametrize("counted", [True, False])
def test_the_kernel_replays_in_a_cuda_graph(m, counted):
    x, w, b = operands(m, 1024, 3072, "cuda", torch.bfloat16)
    counters = tile_counters(1024, "cuda") if counted else None
    eager = linear(x, w, b, counters)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        linear(x, w, b, counters)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x, w, b, counters)
    x.mul_(2)
    for _ in range(3):
        graph.replay()
    torch.testing.assert_close(out, linear(x, w, b), rtol=0, atol=0)  # the same bits as the two-kernel sum
    assert not torch.equal(out, eager)
    assert counters is None or int(counters.abs().sum()) == 0


@pytest.mark.gpu
def test_the_same_inputs_give_the_same_bits():
    x, w, b = operands(8, 1024, 3072, "cuda", torch.bfloat16)
    counters = tile_counters(1024, "cuda")
    first = linear(x, w, b, counters)
    assert all(torch.equal(first, linear(x, w, b, counters)) for _ in range(20))
    assert torch.equal(first, linear(x, w, b))
