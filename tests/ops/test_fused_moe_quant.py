"""The FP8 and 4-bit fused MoE kernels (ops/fused_moe_fp8.py, ops/fused_moe_int4.py) against their
torch reference (ops/moe_quant.py: quant_moe_ref, the same bytes dequantized, then the float MoE),
and that reference against an independent one: fused_moe_ref over weights dequantized here by hand.
On CPU through Triton's interpreter at small shapes; at Qwen3-30B-A3B's and Mixtral's expert shapes
on a GPU in tests/gpu/test_quant_moe_gpu.py."""

from __future__ import annotations

import pytest
import torch

from pagedllm.ops.fp8_linear import FP8
from pagedllm.ops.fused_moe_fp8 import fused_moe_fp8
from pagedllm.ops.fused_moe_int4 import fused_moe_int4
from pagedllm.ops.int4_linear import pack_k
from pagedllm.ops.moe_quant import Fp8Stack, Int4Stack, quant_moe_ref
from pagedllm.ops.moe_ref import fused_moe_ref
from tests.ops.test_fused_moe import routing

SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)


def fp8_stack(e: int, n: int, k: int, block: tuple[int, int] | None, device, seed: int) -> Fp8Stack:
    """Random e4m3 weights with random positive scales (per block, or per output row)."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(e, n, k, generator=g) * 64).clamp(-448, 448).to(FP8)
    shape = (e, n, 1) if block is None else (e, n // block[0], k // block[1])
    scale = torch.rand(shape, generator=g) * 0.5 / (64 * k**0.5) + 1e-4
    return Fp8Stack(weight.to(device), (scale[..., 0] if block is None else scale).to(device), block)


def int4_stack(e: int, n: int, k: int, group: int, desc_act: bool, dtype, device, seed: int) -> Int4Stack:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (e, k, n), generator=g)
    scales = (torch.rand(e, k // group, n, generator=g) + 0.5) / (8 * k**0.5)
    zeros = torch.randint(0, 17, (e, k // group, n), generator=g).to(torch.uint8)  # GPTQ's 1..16 too
    perm = torch.stack([torch.randperm(k, generator=g) for _ in range(e)]).to(torch.int32) if desc_act else None
    return Int4Stack(
        torch.stack([pack_k(q[i]) for i in range(e)]).to(device),
        scales.to(dtype).to(device),
        zeros.to(device),
        perm.to(device) if perm is not None else None,
        group,
    )


def by_hand(stack) -> torch.Tensor:
    """[E, N, K] float32: every expert's weight, element by element from the stack's definition."""
    if isinstance(stack, Fp8Stack):
        e, n, k = stack.weight.shape
        rows = torch.arange(n)[:, None]
        cols = torch.arange(k)[None, :]
        w = stack.weight.float().cpu()
        s = stack.scale.float().cpu()
        if stack.block is None:
            return w * s[:, :, None]
        bn, bk = stack.block
        return w * s[:, rows // bn, cols // bk]
    qw = stack.qweight.cpu()
    e, words, n = qw.shape
    k = words * 8
    rows = torch.arange(k)
    q = (qw[:, rows // 8, :] >> (4 * (rows % 8))[None, :, None]) & 0xF  # [E, K, N]
    grp = rows // stack.group
    wt = (q.float() - stack.zeros.cpu().float()[:, grp]) * stack.scales.cpu().float()[:, grp]
    if stack.perm is not None:  # row k multiplies input column perm[k]
        wt = torch.stack([torch.zeros_like(wt[i]).index_copy_(0, stack.perm[i].cpu().long(), wt[i]) for i in range(e)])
    return wt.transpose(1, 2)


E, H, I = 8, 64, 32  # I: one gate and one up tile of BLOCK_N 16 each, H: two K tiles of 32


@pytest.mark.parametrize("block", [(16, 32), (32, 32), None])
@pytest.mark.parametrize(("t", "kind"), [(1, "random"), (13, "hot")])
def test_fp8_kernel_matches_the_reference(device, block, t, kind):
    w13 = fp8_stack(E, 2 * I, H, block, device, 1)
    w2 = fp8_stack(E, H, I, block, device, 2)
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(3)).to(device)
    w, ids = routing(kind, t, E, 2, device)
    want = quant_moe_ref(x.cpu(), _cpu(w13), _cpu(w2), w.cpu(), ids.cpu())
    got = fused_moe_fp8(x, w13, w2, w, ids, config=SMALL)
    # on a GPU the fp8 dots sum in another order: where that moves an element of the intermediate across
    # an e4m3 rounding boundary, the output moves by one quantization step of it
    atol = 1e-4 if device.type == "cpu" else 1e-2 * float(want.abs().max())
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=atol)


@pytest.mark.parametrize(("group", "desc_act"), [(32, False), (16, True), (64, False)])
@pytest.mark.parametrize(("t", "kind"), [(1, "random"), (13, "hot")])
def test_int4_kernel_matches_the_reference(device, group, desc_act, t, kind):
    g2 = min(group, I)  # a group over the whole input: each expert's down matrix has I rows
    w13 = int4_stack(E, 2 * I, H, group, desc_act, torch.float32, device, 1)
    w2 = int4_stack(E, H, I, g2, desc_act, torch.float32, device, 2)
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(3)).to(device)
    w, ids = routing(kind, t, E, 2, device)
    want = quant_moe_ref(x.cpu(), _cpu(w13), _cpu(w2), w.cpu(), ids.cpu())
    got = fused_moe_int4(x, w13, w2, w, ids, config=SMALL)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def test_int4_reference_is_the_float_moe_of_its_weights():
    """Weight-only: quant_moe_ref is fused_moe_ref over the weights the bytes mean (float32)."""
    w13 = int4_stack(E, 2 * I, H, 16, True, torch.float32, "cpu", 4)
    w2 = int4_stack(E, H, I, 16, True, torch.float32, "cpu", 5)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(6))
    w, ids = routing("random", 9, E, 2, "cpu")
    want = fused_moe_ref(x, by_hand(w13), by_hand(w2), w, ids)
    torch.testing.assert_close(quant_moe_ref(x, w13, w2, w, ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [(16, 32), None])
def test_fp8_reference_quantizes_what_the_float_moe_multiplies(block):
    """W8A8: quant_moe_ref equals a float MoE over the hand-dequantized weights whose inputs (x, then
    the SiLU-and-mul output) are quantized per token (and group of bk columns) before each matmul."""
    w13, w2 = fp8_stack(E, 2 * I, H, block, "cpu", 7), fp8_stack(E, H, I, block, "cpu", 8)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(9))
    w, ids = routing("random", 9, E, 2, "cpu")
    group = None if block is None else block[1]

    def fake(v: torch.Tensor) -> torch.Tensor:
        g = v.shape[-1] if group is None else group
        u = v.unflatten(-1, (-1, g))
        s = (u.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-12)
        return ((u / s).clamp(-448, 448).to(FP8).float() * s).flatten(-2)

    a, b = by_hand(w13), by_hand(w2)
    out = torch.zeros_like(x)
    for tok in range(x.shape[0]):
        for slot in range(2):
            e = int(ids[tok, slot])
            gu = fake(x[tok : tok + 1]) @ a[e].t()
            act = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
            out[tok] += (fake(act) @ b[e].t())[0] * w[tok, slot]
    torch.testing.assert_close(quant_moe_ref(x, w13, w2, w, ids), out, rtol=1e-5, atol=1e-5)


def _cpu(stack):
    if isinstance(stack, Fp8Stack):
        return Fp8Stack(stack.weight.cpu(), stack.scale.cpu(), stack.block)
    perm = stack.perm.cpu() if stack.perm is not None else None
    return Int4Stack(stack.qweight.cpu(), stack.scales.cpu(), stack.zeros.cpu(), perm, stack.group)
