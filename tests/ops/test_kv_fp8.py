"""The Triton kernels on an fp8 KV cache (ops/kv_quant.py) against the torch references.

Store: `store_kvcache` writes the same bytes as `quantize_ref` (saturate(x * inv_scale_of(scale)),
round to nearest even), outliers included. Attention: `paged_attention` over fp8 caches equals
`paged_attention_ref` dequantizing the SAME bytes (the caches are filled by the torch reference
store, so these tests do not depend on the store kernel). Unowned cache slots hold NaN bytes (0x7f):
NaN on a GPU, and in Triton's interpreter (which decodes fp8 without NaN) 480 for e4m3 and
114688 for e5m2, keys large enough to swamp any row that read one.

Tolerance: the reference computes in float32 from stored * scale; the kernel converts the fp8
tiles to q's dtype exactly and differs only as it does on a 16-bit cache (q's dtype for q and
for the probabilities before p @ V, fp32 accumulation order), so the tolerances are those of
test_paged_attention.py for q's dtype, on outputs of size ~1 (dequantized K/V are ~N(0, 1)).
The scales are far from 1 (k_scale 1/80, v_scale 1/50): a kernel that dropped either would be
off by far more than the tolerance.
"""

import pytest
import torch

pytest.importorskip("triton")

from pagedllm.ops import PAD_SLOT_ID  # noqa: E402
from pagedllm.ops.attention_ref import paged_attention_ref, store_kvcache_ref  # noqa: E402
from pagedllm.ops.kv_quant import fp8_max, quantize_ref  # noqa: E402
from pagedllm.ops.paged_attention import paged_attention, paged_attention_decode  # noqa: E402
from pagedllm.ops.store_kv import store_kvcache  # noqa: E402
from tests.ops.test_paged_attention import make_case  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
K_SCALE, V_SCALE = 0.0125, 0.02
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ----------------------------------------------------------------------------- store


def store_inputs(n, hkv, d, fp8, scale, device, seed=0):
    """key/value [n, hkv, d] as strided views of a fused qkv row, holding: every finite value of
    the format times scale, the midpoints between neighbours (ties, exact in float32 when scale
    is a power of two), values just below a power of two (124.3 rounds up to 128 in both
    formats), +-inf, +-1e30 and +-2 * fp8_max * scale (they must saturate), -0.0, and randn."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    grid = grid[torch.isfinite(grid)].sort().values
    m = fp8_max(fp8)
    special = torch.tensor([float("inf"), -float("inf"), 1e30, -1e30, 2 * m, -2 * m, -0.0, 124.3, -124.3, 62.1, 0.99])
    vals = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, special]) * scale
    k = torch.randn(n * hkv * d, generator=g) * 100 * scale
    v = torch.randn(n * hkv * d, generator=g) * 100 * scale
    k[: len(vals)] = vals
    v[-len(vals) :] = vals.flip(0)
    qkv = torch.zeros(n, 3 * hkv * d)
    qkv[:, : hkv * d] = k[torch.randperm(k.numel(), generator=g)].view(n, -1)
    qkv[:, hkv * d : 2 * hkv * d] = v.view(n, -1)
    qkv = qkv.to(device)
    key, value = qkv[:, : hkv * d].view(n, hkv, d), qkv[:, hkv * d : 2 * hkv * d].view(n, hkv, d)
    assert not key.is_contiguous()
    return key, value


def check_store(n, hkv, d, bs, fp8, k_scale, v_scale, device):
    key, value = store_inputs(n, hkv, d, fp8, k_scale, device)
    nblk = -(-n // bs) + 2
    slots = torch.randperm(nblk * bs)[:n].to(device)
    slots[1::5] = PAD_SLOT_ID
    kc = torch.full((nblk, hkv, bs, d), float("nan"), dtype=fp8, device=device)
    vc = torch.full_like(kc, float("nan"))
    kc2, vc2 = kc.clone(), vc.clone()
    store_kvcache(key, value, kc, vc, slots, k_scale, v_scale)
    store_kvcache_ref(key, value, kc2, vc2, slots, k_scale, v_scale)
    assert same_bytes(kc, kc2) and same_bytes(vc, vc2)
    # saturation: finite input never stores NaN, out-of-range input stores +-max
    kept = slots >= 0
    stored = kc.view(torch.uint8)[slots[kept] // bs, :, slots[kept] % bs].view(fp8).float()  # [kept, hkv, d]
    assert torch.isfinite(stored).all()
    big = key[kept].float().abs() > 2 * fp8_max(fp8) * k_scale
    assert big.any() and (stored[big].abs() == fp8_max(fp8)).all()


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("k_scale,v_scale", [(0.25, 4.0), (0.037, 1.7)])
def test_store_fp8_bytes_equal_quantize_ref(fp8, k_scale, v_scale, device):
    """Under the interpreter this runs the kernel's exact-rounding path (its own fp8 cast is
    wrong near powers of two); the GPU tests below run the hardware conversion."""
    check_store(24, 2, 16, 8, fp8, k_scale, v_scale, device)


def test_store_fp8_quantize_ref_examples():
    """The reference the kernel is held to: saturating, round to nearest even."""
    x = torch.tensor([1e6, -1e6, float("inf"), 124.3, 452.0, 464.0, 17.0, 19.0])
    got = quantize_ref(x, 1.0, E4M3).float()
    assert got.tolist() == [448.0, -448.0, 448.0, 128.0, 448.0, 448.0, 16.0, 20.0]


def test_store_scales_ignored_for_16bit_cache(device):
    key, value = torch.randn(2, 5, 2, 16, device=device).to(torch.bfloat16)
    kc = torch.zeros(2, 2, 4, 16, device=device, dtype=torch.bfloat16)
    vc, kc2, vc2 = kc.clone(), kc.clone(), kc.clone()
    slots = torch.tensor([0, 3, PAD_SLOT_ID, 6, 7], device=device)
    store_kvcache(key, value, kc, vc, slots, 0.3, 7.0)
    store_kvcache(key, value, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2) and kc.abs().sum() > 0


# ----------------------------------------------------------------------------- attention


def fp8_case(q_lens, hist, hq, hkv, d, bs, dtype, fp8, device, seed=0):
    """test_paged_attention.make_case with the caches in fp8, stored by the torch reference with
    K_SCALE / V_SCALE; unowned slots hold NaN bytes."""
    return make_case(
        q_lens, hist, hq, hkv, d, bs, dtype, device, seed=seed, kv_dtype=fp8, k_scale=K_SCALE, v_scale=V_SCALE
    )


def check(out, c, dtype):
    ref = paged_attention_ref(**c, k_scale=K_SCALE, v_scale=V_SCALE)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("group,num_splits,dtype", [(2, 1, torch.bfloat16), (4, 3, torch.float32)])
def test_decode_fp8(fp8, group, num_splits, dtype, device):
    """Decode, with and without split-K (the partials are dequantized before the merge)."""
    seq = [1, 17, 40]
    c = fp8_case([1] * 3, [s - 1 for s in seq], 2 * group, 2, 16, 8, dtype, fp8, device, seed=group)
    out = paged_attention_decode(
        c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["seq_lens"], c["scale"],
        num_splits=num_splits, k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    check(out, c, dtype)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mixed_prefill_fp8(fp8, dtype, device):
    """Prefill with a cached prefix and decode in one batch; GQA group 4 shares each K/V tile."""
    q_lens, hist = [1, 9, 4], [13, 16, 0]
    c = fp8_case(q_lens, hist, 4, 1, 32, 8, dtype, fp8, device, seed=3)
    out = paged_attention(**c, max_seqlen_q=max(q_lens), k_scale=K_SCALE, v_scale=V_SCALE)
    check(out, c, dtype)


def test_attention_scales_ignored_for_16bit_cache(device):
    """A cache in q's dtype ignores k_scale / v_scale bit for bit."""
    c = fp8_case([1, 1], [9, 20], 4, 2, 16, 8, torch.float32, E4M3, device)
    c["k_cache"], c["v_cache"] = c["k_cache"].float(), c["v_cache"].float()  # the same values, NaN slots too
    args = (c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["seq_lens"], c["scale"])
    plain = paged_attention_decode(*args)
    assert torch.equal(paged_attention_decode(*args, k_scale=0.5, v_scale=3.0), plain)


# ----------------------------------------------------------------------------- GPU sizes


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("k_scale,v_scale", [(0.25, 0.5), (0.0123, 0.031)])
def test_gpu_store_fp8_large(fp8, k_scale, v_scale, device):
    """The hardware fp32 -> fp8 conversion (round to nearest even, saturated first)."""
    check_store(2048, 8, 128, 16, fp8, k_scale, v_scale, device)


QWEN3 = dict(hq=16, hkv=8, d=128, bs=16)  # Qwen3-0.6B


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8)
def test_gpu_fp8_qwen3_shape(fp8, device):
    s = QWEN3
    g = torch.Generator().manual_seed(1)
    q_lens = [1 if i % 3 else int(torch.randint(2, 200, (1,), generator=g)) for i in range(12)]
    hist = [int(torch.randint(0, 500, (1,), generator=g)) for _ in range(12)]
    c = fp8_case(q_lens, hist, s["hq"], s["hkv"], s["d"], s["bs"], torch.bfloat16, fp8, device)
    check(paged_attention(**c, max_seqlen_q=max(q_lens), k_scale=K_SCALE, v_scale=V_SCALE), c, torch.bfloat16)
    seq = [300, 17, 512, 1, 450, 129, 64, 333]
    c = fp8_case([1] * 8, [n - 1 for n in seq], s["hq"], s["hkv"], s["d"], s["bs"], torch.bfloat16, fp8, device)
    args = (c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["seq_lens"], c["scale"])
    for num_splits in (None, 1, 4):
        out = paged_attention_decode(*args, num_splits=num_splits, k_scale=K_SCALE, v_scale=V_SCALE)
        check(out, c, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_gpu_fp8_decode_cuda_graph(num_splits, device):
    """Captured fp8 decode replays correctly after q and seq_lens change in place (the scales
    are python floats, captured as kernel arguments)."""
    s = QWEN3
    c = fp8_case(
        [1] * 8, [40 * i + 5 for i in range(8)], s["hq"], s["hkv"], s["d"], s["bs"], torch.bfloat16, E4M3, device
    )
    out = torch.empty_like(c["q"])
    args = (c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["seq_lens"], c["scale"])
    kw = dict(num_splits=num_splits, out=out, k_scale=K_SCALE, v_scale=V_SCALE)
    paged_attention_decode(*args, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_decode(*args, **kw)
    c["q"].copy_(torch.randn_like(c["q"]))
    c["seq_lens"].sub_(3)
    graph.replay()
    torch.cuda.synchronize()
    check(out, c, torch.bfloat16)
