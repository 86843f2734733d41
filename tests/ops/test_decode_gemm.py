"""ops/decode_gemm.py: the Triton kernel against the float32 reference (through Triton's interpreter on
CPU at small shapes; at a model's shapes on a GPU, and replayed in a CUDA graph), its split-K sums in a
fixed order, and which products `linear` sends to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.ops import decode_gemm as dg
from pagedllm.ops.decode_gemm import (
    NormIn,
    decode_gemm,
    decode_gemm_config,
    decode_gemm_norm,
    decode_gemm_ref,
    linear,
    linear_act,
    linear_norm,
    split_count,
    tile_counters,
)
from pagedllm.ops.fused_ref import gelu_tanh_and_mul_ref, rms_norm_ref, silu_and_mul_ref

ACT_REFS = {"silu": silu_and_mul_ref, "gelu_pytorch_tanh": gelu_tanh_and_mul_ref}


def operands(m: int, n: int, k: int, device, dtype=torch.float32, seed=0):
    """x [m, k] with rows of very different sizes, W [n, k] and a bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (0.1 + 4 * torch.rand(m, 1, generator=g))
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    return x.to(device, dtype), w.to(device, dtype), b.to(device, dtype)


def assert_close_to(got: torch.Tensor, want: torch.Tensor, roundings: int = 1) -> None:
    """Within float32 summation order (float32 out), or `roundings` roundings of a bf16 / fp16 output."""
    tol = (1e-5 if got.dtype == torch.float32 else 1e-2 * roundings) * float(want.float().abs().amax())
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


@pytest.mark.parametrize("act", sorted(ACT_REFS))
@pytest.mark.parametrize("k,split", [(96, 1), (200, 3), (256, 2)])
def test_the_activation_inside_the_kernel_is_the_activation_then_the_product(device, act, k, split):
    """x = [gate | up] [M, 2K]: the kernel's operand is act(gate) * up rounded to x's dtype, then the
    product, with K off the tile (96, 200: the up half's tail masked like the gate's) and split."""
    x, w, b = operands(5, 48, 2 * k, device, seed=k + split)
    w = w[:, :k].contiguous()
    got = decode_gemm(x, w, b, config=(16, 16, 32, split, 4, 2), counters=tile_counters(48, device), act=act)
    assert_close_to(got, decode_gemm_ref(ACT_REFS[act](x), w, b))
    assert not torch.allclose(got, decode_gemm_ref(x[:, :k], w, b), atol=1e-3)  # not the plain gate


def test_linear_act_declines_what_the_kernel_does_not_take():
    x, w, _ = operands(3, 16, 64, "cpu", torch.bfloat16)
    assert linear_act(x, w[:, :32].contiguous(), "silu") is None  # CPU: the caller's two steps
    with pytest.raises(AssertionError):
        decode_gemm(x, w, act="silu")  # [gate | up] must be twice W's K


def norm_operands(m: int, k: int, device, dtype, seed: int):
    """x and a residual stream of different sizes per row, and a norm weight around 1 (Llama) or 0 (Gemma)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (0.5 + 3 * torch.rand(m, 1, generator=g))
    r = torch.randn(m, k, generator=g) * 2
    nw = 1 + 0.3 * torch.randn(k, generator=g)
    return x.to(device, dtype), r.to(device, dtype), nw.to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("m,k,split", [(1, 96, 1), (5, 200, 3), (16, 256, 2), (20, 128, 1), (3, 600, 2)])
def test_the_norm_inside_the_kernel_is_the_norm_then_the_product(
    device, dtype, unit_offset, with_residual, m, k, split
):
    """The operand is RMSNorm(x + residual) (Llama's w * round(normed), Gemma's (1 + w) * normed),
    with K off the tile (96, 200), split (3: uneven), rows past one row tile (20), the mean square
    over more than one of its tiles (600: 512 and a masked tail); the residual
    stream's next value is x + residual rounded once, written whole by one program."""
    x, r, nw = norm_operands(m, k, device, dtype, seed=m + k + split)
    _, w, b = operands(m, 48, k, device, dtype, seed=k)
    if unit_offset:
        nw = nw - 1
    norm = NormIn(nw, 1e-6, unit_offset, r if with_residual else None)
    got, new_r = decode_gemm_norm(x, norm, w, b, config=(16, 16, 32, split, 4, 2), counters=tile_counters(48, device))
    ref = rms_norm_ref(x, nw, 1e-6, r if with_residual else None, unit_offset=unit_offset)
    normed, want_r = ref if with_residual else (ref, x)
    if dtype == torch.float32 or device.type == "cuda":
        assert torch.equal(new_r, want_r)
    else:  # the interpreter rounds float32 -> bfloat16 toward zero, torch to nearest: one unit apart
        torch.testing.assert_close(new_r.float(), want_r.float(), rtol=2**-7, atol=0)
    assert_close_to(got, decode_gemm_ref(normed, w, b), roundings=1 if device.type == "cuda" else 2)
    plain = decode_gemm_ref(x, w, b)
    assert not torch.allclose(got.float(), plain.float(), atol=1e-2 * float(plain.float().abs().amax()))


def test_linear_norm_declines_what_the_kernel_does_not_take(monkeypatch):
    x, r, nw = norm_operands(3, 64, "cpu", torch.bfloat16, seed=1)
    _, w, _ = operands(3, 16, 64, "cpu", torch.bfloat16)
    monkeypatch.setenv("PAGEDLLM_DECODE_FUSION", "1")
    assert linear_norm(x, NormIn(nw, 1e-6, False, r), w) is None  # CPU: the caller's two steps
    monkeypatch.setattr(dg, "wanted", lambda x, w: True)  # where the kernel would take it ...
    monkeypatch.setenv("PAGEDLLM_DECODE_FUSION", "0")  # ... but the fusion is off
    assert linear_norm(x, NormIn(nw, 1e-6, False, r), w) is None
    assert linear_act(x, w[:, :32].contiguous(), "silu") is None
    with pytest.raises(AssertionError, match="not both"):
        dg._launch(x, w[:, :32].contiguous(), None, None, None, "silu", NormIn(nw[:32], 1e-6, False, None))


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
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(4096, 1024), (6144, 1024), (2048, 2560)])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_the_norm_inside_the_kernel_at_real_shapes(m, n, k, unit_offset, with_residual, monkeypatch):
    """Qwen3-0.6B's qkv and gate_up, a larger hidden size: the residual stream's next value bit for
    bit, the product within one rounding of the reference and of the two launches (norm, then GEMM)."""
    from pagedllm.ops.fused import rms_norm

    monkeypatch.setenv("PAGEDLLM_DECODE_FUSION", "1")
    x, r, nw = norm_operands(m, k, "cuda", torch.bfloat16, seed=m + n)
    _, w, b = operands(m, n, k, "cuda", torch.bfloat16, seed=k)
    if unit_offset:
        nw = nw - 1
    residual = r if with_residual else None
    fused = linear_norm(x, NormIn(nw, 1e-6, unit_offset, residual), w, b, tile_counters(n, "cuda"))
    assert fused is not None
    got, new_r = fused
    ref = rms_norm_ref(x, nw, 1e-6, residual, unit_offset=unit_offset)
    normed, want_r = ref if with_residual else (ref, x)
    assert torch.equal(new_r, want_r)
    assert_close_to(got, decode_gemm_ref(normed, w, b))
    two = rms_norm(x, nw, 1e-6, residual=residual, unit_offset=unit_offset)
    assert_close_to(got, linear(two[0] if with_residual else two, w, b, tile_counters(n, "cuda")))


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
@pytest.mark.parametrize("act", sorted(ACT_REFS))
@pytest.mark.parametrize("m", [1, 4, 16])
def test_the_activation_inside_gives_the_bits_of_the_two_launches(act, m, monkeypatch):
    """Qwen3-0.6B's down projection: linear_act equals ops/fused.py's activation kernel followed by
    the decode GEMM, bit for bit (same formulas, same rounding, same sums)."""
    from pagedllm.ops import fused

    monkeypatch.setenv("PAGEDLLM_DECODE_FUSION", "1")
    x, w, _ = operands(m, 1024, 6144, "cuda", torch.bfloat16, seed=m)
    w = w[:, :3072].contiguous()
    two = {"silu": fused.silu_and_mul, "gelu_pytorch_tanh": fused.gelu_tanh_and_mul}[act](x)
    counters = tile_counters(1024, "cuda")
    fused_out = linear_act(x, w, act, None, counters)
    assert fused_out is not None and torch.equal(fused_out, linear(two, w, None, counters))
    assert linear_act(x.repeat(17, 1), w, act) is None  # past the row limit: the caller's two steps


@pytest.mark.gpu
def test_the_same_inputs_give_the_same_bits():
    x, w, b = operands(8, 1024, 3072, "cuda", torch.bfloat16)
    counters = tile_counters(1024, "cuda")
    first = linear(x, w, b, counters)
    assert all(torch.equal(first, linear(x, w, b, counters)) for _ in range(20))
    assert torch.equal(first, linear(x, w, b))
