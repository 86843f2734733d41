"""The fused q/k norm + rotary + KV store kernel (ops/prepare_qkv.py) against the torch
composition the CPU path runs (TorchKernels.prepare_qkv: rms_norm_ref per head,
apply_rotary_ref, store_kvcache_ref).

q and k are compared within the fused-kernel tolerances of test_fused.py (the interpreter
rounds fp32 -> bf16 by truncation); the caches are compared bytewise with what the torch store
writes from the kernel's own k and the untouched v, so a slot written wrongly, a padded slot
written, or an fp8 value quantized otherwise than store_kv's way fails exactly.
"""

import pytest
import torch

pytest.importorskip("triton")

from pagedllm.ops import PAD_SLOT_ID  # noqa: E402
from pagedllm.ops.attention_ref import store_kvcache_ref  # noqa: E402
from pagedllm.ops.kernels import TorchKernels  # noqa: E402
from pagedllm.ops.prepare_qkv import prepare_qkv  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
E4M3 = torch.float8_e4m3fn


def rope_table(max_pos: int, rot: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def case(t, hq, hkv, d, rot, dtype, qk_norm, device, nblk=4, bs=4, cache_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype)
    weights = tuple((1 + 0.5 * torch.randn(d, generator=g)).to(dtype) for _ in range(2)) if qk_norm else (None, None)
    positions = torch.randint(0, 50, (t,), generator=g)
    slots = torch.randperm(nblk * bs, generator=g)[:t]
    slots[1::3] = PAD_SLOT_ID
    cache = torch.full((nblk, hkv, bs, d), float("nan"), dtype=cache_dtype or dtype)
    return dict(qkv=qkv, weights=weights, positions=positions, slots=slots, cache=cache, table=rope_table(64, rot))


def views(qkv, hq, hkv, d):
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)


def same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def run_both(c, hq, hkv, d, device, unit_offset=False, eps=1e-6, scales=(1.0, 1.0), bind=True):
    """(kernel q, k, k_cache, v_cache), (reference q, k, k_cache, v_cache), the kernel's v."""
    to = {k: (tuple(w.to(device) if w is not None else None for w in x) if k == "weights" else x.to(device))
          for k, x in c.items()}  # fmt: skip
    got_qkv = to["qkv"].clone()
    q, k, v = views(got_qkv, hq, hkv, d)
    kc, vc = (to["cache"].clone(), to["cache"].clone()) if bind else (torch.tensor([]), torch.tensor([]))
    args = (to["positions"], to["table"], *to["weights"], eps, unit_offset)
    gq, gk = prepare_qkv(q, k, v, *args, kc, vc, to["slots"], *scales)
    assert gq.data_ptr() == q.data_ptr() and gk.data_ptr() == k.data_ptr()  # in place, in the qkv tensor
    rq, rk, rv = views(c["qkv"].clone(), hq, hkv, d)
    rkc, rvc = (c["cache"].clone(), c["cache"].clone()) if bind else (torch.tensor([]), torch.tensor([]))
    wq, wk = c["weights"]
    ref_q, ref_k = TorchKernels().prepare_qkv(
        rq, rk, rv, c["positions"], c["table"], wq, wk, eps, unit_offset, rkc, rvc, c["slots"], *scales
    )
    return (gq.cpu(), gk.cpu(), kc.cpu(), vc.cpu()), (ref_q, ref_k, rkc, rvc), v.cpu()


def check(got, ref, v, c, dtype, scales=(1.0, 1.0)):
    gq, gk, kc, vc = got
    ref_q, ref_k, _, _ = ref
    torch.testing.assert_close(gq.float(), ref_q.float(), **TOL[dtype])
    torch.testing.assert_close(gk.float(), ref_k.float(), **TOL[dtype])
    if kc.numel():  # the cache holds exactly what the torch store writes from this k and v
        want_k, want_v = c["cache"].clone(), c["cache"].clone()
        store_kvcache_ref(gk, v, want_k, want_v, c["slots"], *scales)
        assert same_bytes(kc, want_k) and same_bytes(vc, want_v)
        assert not torch.isnan(kc.float()).all()  # something was stored


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm,unit_offset", [(False, False), (True, False), (True, True)])
def test_matches_the_torch_composition(qk_norm, unit_offset, dtype, device):
    """GQA (4 q heads, 2 kv heads), strided views of one qkv tensor, a padded slot every third token."""
    hq, hkv, d = 4, 2, 32
    c = case(7, hq, hkv, d, d, dtype, qk_norm, device)
    got, ref, v = run_both(c, hq, hkv, d, device, unit_offset=unit_offset)
    check(got, ref, v, c, dtype)
    # the norm changed q (a kernel that skipped it would still rotate)
    if qk_norm:
        _, plain, _ = run_both({**c, "weights": (None, None)}, hq, hkv, d, device)
        assert not torch.allclose(got[0].float(), plain[0].float(), atol=0.1)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_partial_rotary(qk_norm, device):
    """Phi-3: only the first rot = 16 of 32 dims turn; the tail is normed (if qk_norm) but not rotated."""
    hq, hkv, d = 2, 1, 32
    c = case(5, hq, hkv, d, 16, torch.float32, qk_norm, device)
    got, ref, v = run_both(c, hq, hkv, d, device)
    check(got, ref, v, c, torch.float32)
    if not qk_norm:  # the tail is the projection's, untouched
        _, k0, _ = views(c["qkv"], hq, hkv, d)
        assert torch.equal(got[1][..., 16:], k0[..., 16:])


def test_fp8_cache(device):
    """e4m3 cache, scales far from 1: the kernel quantizes its k and the v as store_kv does."""
    hq, hkv, d, scales = 4, 2, 32, (0.0125, 0.02)
    c = case(6, hq, hkv, d, d, torch.float32, True, device, cache_dtype=E4M3)
    got, ref, v = run_both(c, hq, hkv, d, device, scales=scales)
    check(got, ref, v, c, torch.float32, scales)


def test_no_cache_bound(device):
    """The profiling forward (empty caches): q and k prepared, nothing stored (and no slot read)."""
    hq, hkv, d = 4, 2, 32
    c = case(3, hq, hkv, d, d, torch.bfloat16, True, device)
    got, ref, v = run_both(c, hq, hkv, d, device, bind=False)
    check(got, ref, v, c, torch.bfloat16)


def test_no_tokens(device):
    q = k = v = torch.empty(0, 2, 32, device=device)
    out = prepare_qkv(q, k, v, torch.empty(0, dtype=torch.int64, device=device), rope_table(8, 32).to(device),
                      None, None, 1e-6, False, torch.tensor([]), torch.tensor([]), torch.empty(0, dtype=torch.int64))  # fmt: skip
    assert out[0].shape == (0, 2, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 600])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_gpu_real_shapes_bitwise_equal_the_separate_kernels(t, qk_norm, device):
    """Qwen3-0.6B's attention shape (16 q heads, 8 kv heads, head_dim 128) in bf16 on the GPU:
    the same bits as rms_norm -> apply_rotary -> store_kvcache run one after the other, and close
    to the torch composition."""
    from pagedllm.ops.fused import apply_rotary, rms_norm
    from pagedllm.ops.store_kv import store_kvcache

    hq, hkv, d, eps = 16, 8, 128, 1e-6
    c = case(t, hq, hkv, d, d, torch.bfloat16, qk_norm, device, nblk=64, bs=16)
    c["table"] = rope_table(4096, d)
    c["positions"] = torch.randint(0, 4096, (t,))
    got, ref, v = run_both(c, hq, hkv, d, device, eps=eps)
    check(got, ref, v, c, torch.bfloat16)
    q, k, v = views(c["qkv"].to(device), hq, hkv, d)
    if qk_norm:
        wq, wk = (w.to(device) for w in c["weights"])
        q, k = rms_norm(q, wq, eps), rms_norm(k, wk, eps)
    q, k = apply_rotary(q, k, c["table"].to(device), c["positions"].to(device))
    kc, vc = c["cache"].to(device), c["cache"].to(device)
    store_kvcache(k, v, kc, vc, c["slots"].to(device))
    assert torch.equal(got[0], q.cpu()) and torch.equal(got[1], k.cpu())
    assert same_bytes(got[2], kc.cpu()) and same_bytes(got[3], vc.cpu())
