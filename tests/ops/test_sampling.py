"""Fused Gumbel-max sampling and its noise against torch / numpy references.

The interpreter runs ~10 ms per sampling program on CPU, so CPU shapes stay small
(B <= 8, V <= 3000, a few hundred rows for the frequency test); the GPU tests use real ones.
"""

import math

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from pagedllm.ops.sampling import (  # noqa: E402
    exponential_noise,
    gumbel_sample,
    gumbel_sample_ref,
    philox_uniform_ref,
    row_seeds,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# int64 seeds that exercise both key words of Philox (sign bit, high word only, low only)
ODD_SEEDS = [0, 1, -1, 2**63 - 1, -(2**63), 1 + 2**40, 2**40, 123456789]


def make_logits(b, v, dtype, device, seed=0, scale=1.0, strided=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, v + 37 if strided else v, generator=g) * scale
    x = x.to(dtype).to(device)
    return x[:, 5 : 5 + v] if strided else x


def seeds_for(b, device, base=7, pos=3):
    s = row_seeds(np.arange(base, base + b, dtype=np.int64), np.full(b, pos, dtype=np.int64))
    return torch.from_numpy(s).to(device)


def check_freqs(tokens, probs, n_se=4.5):
    """Per-token frequencies within n_se standard errors of probs; returns the counts."""
    n = tokens.numel()
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    assert counts.numel() == probs.numel()
    p = probs.double().cpu()
    se = (p * (1 - p) / n).sqrt()
    assert ((counts / n - p).abs() <= n_se * se + 1e-12).all(), (counts / n, p)
    return counts


# ----------------------------------------------------------------------------- noise


def test_philox_ref_known_answer():
    # Random123 KAT for Philox4x32-10, counter 0 and key 0, through Triton's uint -> float
    words = np.array([0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8], np.uint32).view(np.int32)
    u = np.where(words < 0, ~words, words).astype(np.float32) * np.float32(4.6566127342e-10)
    np.testing.assert_array_equal(philox_uniform_ref(np.array([0]), 4)[0], u)


def test_noise_matches_philox_ref(device):
    v = 2501  # neither a multiple of 4 nor of BLOCK
    seeds = torch.tensor(ODD_SEEDS, dtype=torch.int64, device=device)
    e = exponential_noise(seeds, v, device)
    assert e.shape == (len(ODD_SEEDS), v) and e.dtype == torch.float32
    ref = -np.log(philox_uniform_ref(seeds.cpu().numpy(), v))
    torch.testing.assert_close(e.cpu(), torch.from_numpy(ref), rtol=1e-5, atol=1e-6)
    assert (e > 0).all()
    # every seed its own stream, high key word included (1 vs 1 + 2**40)
    for i in range(len(ODD_SEEDS)):
        for j in range(i):
            assert (e[i] != e[j]).float().mean() > 0.99


def test_noise_distribution(device):
    """E ~ Exp(1), independent across columns (the 4 words of one Philox call included)."""
    seeds = seeds_for(8, device)
    e = exponential_noise(seeds, 8192, device).double().cpu().flatten()  # 65536 draws
    n = e.numel()
    assert abs(e.mean() - 1) < 4.5 / math.sqrt(n)  # sd of Exp(1) is 1
    p_gt1 = math.exp(-1)
    assert abs((e > 1).double().mean() - p_gt1) < 4.5 * math.sqrt(p_gt1 * (1 - p_gt1) / n)
    for lag in (1, 2, 3, 4, 1024):
        c = torch.corrcoef(torch.stack([e[:-lag], e[lag:]]))[0, 1]
        assert abs(c) < 4.5 / math.sqrt(n), (lag, c)


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("num_chunks", [None, 1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_matches_argmax(dtype, num_chunks, device):
    b, v = 8, 3000
    x = make_logits(b, v, dtype, device, seed=1, scale=3.0, strided=True)
    x[1, ::2] = float("-inf")
    x[2, :] = float("-inf")  # torch.argmax picks 0
    x[3, :-1] = float("-inf")  # only the last (masked-tile) column left
    top = x[4].max() + 1  # ties: lowest index, across lanes/tiles/chunks
    x[4, [2900, 1024 + 7, 2048 + 7, 7 + 3]] = top
    x[5, [2999, 2100]] = x[5].max() + 1
    assert (x != 0).all()
    temp = torch.zeros(b, device=device)
    temp[6] = -1.0  # T <= 0 is greedy
    out = gumbel_sample(x, temp, seeds_for(b, device), num_chunks=num_chunks)
    assert out.dtype == torch.int64 and out.shape == (b,)
    assert torch.equal(out, x.argmax(dim=-1))
    assert out[4].item() == 10 and out[5].item() == 2100 and out[2].item() == 0


@pytest.mark.parametrize("num_chunks", [None, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_matches_ref(dtype, num_chunks, device):
    b, v = 8, 2900
    x = make_logits(b, v, dtype, device, seed=2, strided=True)
    x[3, 100:] = float("-inf")
    temp = torch.tensor([1.0, 0.0, 0.7, 1.3, 0.0, 2.0, 0.05, 1.0], device=device)
    seeds = seeds_for(b, device)
    out = gumbel_sample(x, temp, seeds, num_chunks=num_chunks)
    ref = gumbel_sample_ref(x, temp, exponential_noise(seeds, v, device))
    assert torch.equal(out, ref), (out, ref)
    assert out[3] < 100
    hot = temp > 0.5  # flat logits: sampling is not argmax there
    assert (out[hot] != x[hot].argmax(dim=-1)).all()
    assert torch.equal(out[temp == 0], x[temp == 0].argmax(dim=-1))


def test_sample_minus_inf(device):
    b, v = 4, 1500
    x = make_logits(b, v, torch.float32, device, seed=3)
    x[0, :] = float("-inf")
    x[0, 1234] = -50.0  # the only finite logit, even if tiny
    x[1, ::2] = float("-inf")
    x[2, :] = float("-inf")  # nothing finite: index 0, like the ref
    temp = torch.full((b,), 1.0, device=device)
    seeds = seeds_for(b, device)
    out = gumbel_sample(x, temp, seeds, num_chunks=2)
    assert out[0] == 1234 and out[1] % 2 == 1 and out[2] == 0
    assert torch.equal(out, gumbel_sample_ref(x, temp, exponential_noise(seeds, v, device)))


def test_determinism_and_row_independence(device):
    b, v = 6, 2100
    x = make_logits(b, v, torch.bfloat16, device, seed=4, scale=0.5)
    temp = torch.tensor([1.0, 0.8, 0.0, 1.5, 1.0, 1.0], device=device)
    seeds = seeds_for(b, device)
    out = gumbel_sample(x, temp, seeds)
    assert torch.equal(out, gumbel_sample(x, temp, seeds))
    perm = torch.tensor([3, 0, 5, 1, 4, 2], device=device)
    assert torch.equal(gumbel_sample(x[perm], temp[perm], seeds[perm]), out[perm])
    for r in (0, 3):  # alone (other chunking) = in the batch
        assert gumbel_sample(x[r : r + 1], temp[r : r + 1], seeds[r : r + 1]).item() == out[r]
    # the same seed and logits in two rows give the same token; new seeds new tokens
    same = gumbel_sample(x[[0, 0]], temp[[0, 0]], seeds[[0, 0]])
    assert same[0] == same[1] == out[0]
    flat = torch.zeros(b, v, device=device)  # uniform over 2100 tokens
    ones = torch.ones(b, device=device)
    t1, t2 = gumbel_sample(flat, ones, seeds), gumbel_sample(flat, ones, seeds + 1)
    assert len(set(t1.tolist())) == b and (t1 != t2).all()


@pytest.mark.parametrize("temp", [0.7, 1.6])
def test_sample_distribution(temp, device):
    """Frequencies of 256 draws (one per row, distinct seeds) follow softmax(logits / T)."""
    n = 256
    pattern = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, float("-inf")])
    x = pattern.to(device).expand(n, -1)  # row stride 0
    seeds = seeds_for(n, device, base=1000)
    out = gumbel_sample(x, torch.full((n,), temp, device=device), seeds)
    probs = (pattern / temp).softmax(-1)
    counts = check_freqs(out, probs)
    assert counts[-1] == 0
    # the check can fail: T = 1 (temperature ignored) is > 4.5 SE away in some token
    se = (probs * (1 - probs) / n).sqrt()
    assert ((pattern.softmax(-1) - probs).abs() > 4.5 * se).any()


def test_noise_sampling_distribution(device):
    """Many draws through gumbel_sample_ref on the kernel's noise, cut into groups of 8."""
    e = exponential_noise(seeds_for(8, device, base=50), 8 * 1024, device).reshape(-1, 8)
    n = e.shape[0]  # 8192 draws
    pattern = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0], device=device)
    temp = torch.full((n,), 0.8, device=device)
    check_freqs(gumbel_sample_ref(pattern.expand(n, -1), temp, e), (pattern / 0.8).softmax(-1))


# ----------------------------------------------------------------------------- row seeds

_M64 = (1 << 64) - 1


def _mix64_py(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def test_row_seeds():
    base = np.array([0, 1, -1, 2**63 - 1, -(2**63), 42], dtype=np.int64)
    pos = np.array([0, 1, 2, 3, 4, 100000], dtype=np.int64)
    s = row_seeds(base, pos)
    assert s.dtype == np.int64 and s.shape == base.shape and (s >= 0).all()
    expect = [
        _mix64_py((_mix64_py(int(b) & _M64) + 0x9E3779B97F4A7C15 * (int(p) + 1)) & _M64) >> 1
        for b, p in zip(base, pos, strict=False)
    ]
    assert s.tolist() == expect
    assert np.array_equal(row_seeds(base, pos), s)
    assert np.array_equal(row_seeds(base.view(np.uint64), pos), s)  # uint64 = two's compl.
    # 64 seeds x 64 positions: all distinct, and spread over [0, 2**63)
    bb, pp = np.meshgrid(np.arange(64, dtype=np.int64), np.arange(64, dtype=np.int64))
    grid = row_seeds(bb.ravel(), pp.ravel())
    assert len(set(grid.tolist())) == grid.size
    assert grid.max() > 2**62 and grid.min() < 2**61


# ----------------------------------------------------------------------------- GPU sizes


def _gpu_case(b, v, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(b, v + 64, device=device, generator=g).to(torch.bfloat16)[:, :v]
    temp = torch.rand(b, device=device, generator=g) * 1.5 + 0.1
    temp[::7] = 0.0
    seeds = torch.from_numpy(row_seeds(np.arange(b, dtype=np.int64) * 977, np.arange(b, dtype=np.int64) + 12)).to(
        device
    )
    return x, temp, seeds


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 237, 256])
def test_gpu_large(b, device):
    v = 151936
    x, temp, seeds = _gpu_case(b, v, device)
    out = gumbel_sample(x, temp, seeds)
    noise = exponential_noise(seeds, v, device)
    assert torch.equal(out, gumbel_sample_ref(x, temp, noise))
    greedy = temp == 0
    assert torch.equal(out[greedy], x[greedy].argmax(dim=-1))
    assert torch.equal(out, gumbel_sample(x, temp, seeds, num_chunks=1))
    # the unfused path's draw, argmax(probs / E), picks the same tokens
    probs = (x.float() / torch.where(greedy, 1.0, temp)[:, None]).softmax(-1)
    unfused = torch.where(greedy, x.argmax(-1), (probs / noise).argmax(-1))
    assert (unfused == out).float().mean() > 0.99
    u = philox_uniform_ref(seeds[:2].cpu().numpy(), v)
    torch.testing.assert_close(noise[:2].cpu(), torch.from_numpy(-np.log(u)), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_distribution(device):
    n = 65536
    pattern = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, float("-inf")], device=device)
    seeds = torch.from_numpy(row_seeds(np.full(n, 5, np.int64), np.arange(n))).to(device)
    out = gumbel_sample(pattern.expand(n, -1), torch.full((n,), 0.9, device=device), seeds)
    check_freqs(out, (pattern / 0.9).softmax(-1))


@pytest.mark.gpu
def test_gpu_cuda_graph(device):
    b, v = 64, 151936
    x, temp, seeds = _gpu_case(b, v, device, seed=1)
    out = torch.empty(b, dtype=torch.int64, device=device)
    gumbel_sample(x, temp, seeds, out=out)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gumbel_sample(x, temp, seeds, out=out)
    x.copy_(torch.randn_like(x))
    seeds.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gumbel_sample_ref(x, temp, exponential_noise(seeds, v, device)))
