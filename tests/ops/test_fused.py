"""Fused norm / activation / rotary kernels against their torch references (fused_ref.py), which
are what the CPU path runs (ops/kernels.py: TorchKernels; tests/ops/test_kernels.py)."""

import pytest
import torch

pytest.importorskip("triton")

from pagedllm.ops.fused import apply_rotary, gelu_tanh_and_mul, rms_norm, silu_and_mul  # noqa: E402
from pagedllm.ops.fused_ref import (  # noqa: E402
    apply_rotary_ref,
    gelu_tanh_and_mul_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)

# The interpreter rounds fp32 -> bf16 by truncation, the GPU to nearest: allow 1 bf16 ulp.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def close(a, b, dtype):
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm(hidden, dtype, device):
    x = torch.randn(2, 5, hidden, device=device).to(dtype) * 3
    w = (1 + 0.5 * torch.randn(hidden, device=device)).to(dtype)
    close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm(dtype, device):
    x = torch.randn(7, 80, device=device).to(dtype)
    r = torch.randn(7, 80, device=device).to(dtype)
    w = torch.randn(80, device=device).to(dtype)
    out, new_res = rms_norm(x, w, 1e-5, residual=r)
    out_ref, res_ref = rms_norm_ref(x, w, 1e-5, residual=r)
    close(out, out_ref, dtype)
    close(new_res, res_ref, dtype)
    close(new_res, (x.float() + r.float()).to(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_unit_offset_rms_norm(dtype, with_residual, device):
    """Gemma's form: scaled by (1 + w), in fp32, rounded once."""
    x = torch.randn(7, 80, device=device).to(dtype) * 2
    r = torch.randn(7, 80, device=device).to(dtype) if with_residual else None
    w = (0.3 * torch.randn(80, device=device)).to(dtype)
    got, want = rms_norm(x, w, 1e-6, r, unit_offset=True), rms_norm_ref(x, w, 1e-6, r, unit_offset=True)
    for a, b in zip(got, want, strict=True) if with_residual else [(got, want)]:
        close(a, b, dtype)


def test_unit_offset_rms_norm_ref_is_hf_gemma():
    """Independent check against HF's Gemma2RMSNorm.forward, written out: normalise x.float(),
    times (1.0 + w.float()), .type_as(x)."""

    def hf_gemma_norm(x, w, eps):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(x)

    for dtype in (torch.float32, torch.bfloat16):
        w = (0.5 * torch.randn(48)).to(dtype)
        x, r = torch.randn(5, 48).to(dtype) * 3, torch.randn(5, 48).to(dtype)
        assert torch.equal(rms_norm_ref(x, w, 1e-6, unit_offset=True), hf_gemma_norm(x, w, 1e-6))
        out, res = rms_norm_ref(x, w, 1e-6, r, unit_offset=True)
        assert torch.equal(res, x + r) and torch.equal(out, hf_gemma_norm(x + r, w, 1e-6))
    assert not torch.allclose(rms_norm_ref(x, w, 1e-6).float(), hf_gemma_norm(x, w, 1e-6).float())


def test_rms_norm_strided_rows(device):
    big = torch.randn(6, 2 * 64, device=device)
    x = big[:, :64]  # row stride 128
    w = torch.randn(64, device=device)
    close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [48, 1100])
def test_silu_and_mul(inter, dtype, device):
    x = torch.randn(3, 2, 2 * inter, device=device).to(dtype) * 2
    out = silu_and_mul(x)
    assert out.shape == (3, 2, inter)
    close(out, silu_and_mul_ref(x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [48, 1100])
def test_gelu_tanh_and_mul(inter, dtype, device):
    x = torch.randn(3, 2, 2 * inter, device=device).to(dtype) * 3
    out = gelu_tanh_and_mul(x)
    assert out.shape == (3, 2, inter)
    close(out, gelu_tanh_and_mul_ref(x), dtype)


def test_gelu_tanh_and_mul_ref_is_hf_geglu():
    """Independent check: HF's gelu_pytorch_tanh is the tanh formula; GeGLU is act(gate) * up."""
    x = torch.randn(6, 2 * 40) * 4
    gate, up = x[:, :40], x[:, 40:]
    gelu = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)))
    torch.testing.assert_close(gelu_tanh_and_mul_ref(x), gelu * up, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(gelu_tanh_and_mul_ref(x), silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,rot", [(4, 2, 64, 64), (3, 1, 32, 32), (2, 2, 64, 32)])
def test_apply_rotary_in_place_on_qkv_views(hq, hkv, d, rot, dtype, device):
    t, max_pos = 9, 40
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=device).to(dtype)
    q, k = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, device=device).float() / rot))
    freqs = torch.arange(max_pos, device=device).float()[:, None] * inv[None, :]
    cache = torch.cat([freqs.cos(), freqs.sin()], -1)
    pos = torch.randint(0, max_pos, (t,), device=device)
    q_ref, k_ref = apply_rotary_ref(q, k, cache, pos)
    apply_rotary(q, k, cache, pos)
    close(q, q_ref, dtype)
    close(k, k_ref, dtype)
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)  # v untouched


def test_apply_rotary_matches_hf_rotate_half(device):
    """Independent check against the HF Llama formula (q * cos + rotate_half(q) * sin)."""
    t, h, d = 5, 2, 16
    q, k = torch.randn(t, h, d, device=device), torch.randn(t, h, d, device=device)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d))
    pos = torch.tensor([0, 3, 7, 1, 12], device=device)
    freqs = pos.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], -1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()

    def rotate_half(x):
        return torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)

    q_hf, k_hf = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    table = torch.arange(13, device=device).float()[:, None] * inv[None, :]
    cache = torch.cat([table.cos(), table.sin()], -1)
    q2, k2 = apply_rotary(q.clone(), k.clone(), cache, pos)
    close(q2, q_hf, torch.float32)
    close(k2, k_hf, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fused_large(dtype, device):
    x = torch.randn(4096, 4096, device=device, dtype=dtype)
    r = torch.randn_like(x)
    w = torch.randn(4096, device=device, dtype=dtype)
    out, res = rms_norm(x, w, 1e-6, r)
    out_ref, res_ref = rms_norm_ref(x, w, 1e-6, r)
    torch.testing.assert_close(res, res_ref, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), out_ref.float(), atol=2e-2, rtol=2e-2)
    g = torch.randn(4096, 2 * 3072, device=device, dtype=dtype)
    torch.testing.assert_close(silu_and_mul(g).float(), silu_and_mul_ref(g).float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gelu_tanh_and_mul(g).float(), gelu_tanh_and_mul_ref(g).float(), atol=2e-2, rtol=2e-2)
    out, res = rms_norm(x, w, 1e-6, r, unit_offset=True)
    out_ref, res_ref = rms_norm_ref(x, w, 1e-6, r, unit_offset=True)
    torch.testing.assert_close(res, res_ref, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), out_ref.float(), atol=2e-2, rtol=2e-2)
