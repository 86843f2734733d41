"""Fused Gumbel-max sampling (Triton): one read of the [B, V] logits per decode step.

Noise. Row r draws its noise from Triton's Philox4x32-10 keyed by the int64 seed
`seeds[r]`; one Philox call yields 4 words, so column j takes word j % 4 of
`tl.rand4x(seed_r, j // 4)`:
    u[r, j] in [0, 1)            (Triton's int32 -> float conversion; u = 0 has p ~ 2^-31)
    E[r, j] = -log(u[r, j])      exponential noise (u = 0 gives inf: that token is never drawn)
    g[r, j] = -log(E[r, j])      Gumbel noise
rand4x rather than tl.rand (which throws 3 of the 4 words away) makes Philox, the dominant
cost of the fused kernel, 4x cheaper. `philox_uniform_ref` is the same definition in numpy.

Seeds. `tl.rand4x(seed, offset)` casts the seed to uint64 and, for 32-bit offsets, keys
Philox with its low and high 32-bit words, so all 64 bits of a seed loaded from memory
count. `row_seeds` still returns values in [0, 2**63) so they are plain non-negative int64
(no sign reinterpretation anywhere). Seeds are read from a device tensor, not passed as
scalar kernel arguments: a python-int argument would be specialised by Triton (== 1, % 16)
and typed by value (>= 2**63 -> uint64), i.e. recompiles, and could not change under a
captured CUDA graph.

Sampling. `gumbel_sample` returns argmax_j(logits / T + g) for rows with T > 0 (a draw
from softmax(logits / T)) and plain argmax_j logits for rows with T <= 0 (no noise; ties go
to the lowest index, like torch.argmax). Grid (B, C): each program scans one chunk of whole
tiles and writes its (max, lowest argmax) to [B, C] scratch; a second tiny kernel reduces
over C (lowest chunk wins ties, so ties still go to the lowest index). Divisions use
round-to-nearest (`div_rn`), so the scores equal torch's `logits.float() / T` bit for bit.
NaN logits are never picked (torch.argmax would pick them).

`exponential_noise` writes E itself, so the unfused sampler path (top-k / top-p / min-p)
draws with argmax(probs / E) the same token the fused kernel would for the same seeds;
`gumbel_sample_ref` is the torch reference of the fused kernel given E.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.ops._triton import HAS_TRITON, num_sms, require_triton, tl, triton

BLOCK = 1024  # columns per tile (8 per thread at 4 warps), multiple of 4
NOISE_BLOCK = 1024  # columns per program of the noise kernel
PROGRAMS_PER_SM = 8  # fused-kernel chunking target, see _num_chunks
MAX_CHUNKS = 256  # chunks per row at most: the reduce kernel's fixed width, so
# it compiles once, not once per power of two of the batch

_INT32_MAX = 2**31 - 1

# ----------------------------------------------------------------------------- references

_PHILOX_KEY_A, _PHILOX_KEY_B = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_PHILOX_ROUND_A, _PHILOX_ROUND_B = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_M32 = np.uint64(0xFFFFFFFF)
_UNIFORM_SCALE = np.float32(4.6566127342e-10)  # as in triton.language.random


def philox_uniform_ref(seeds, vocab: int) -> np.ndarray:
    """u [B, vocab] float32 of the noise definition above, in numpy (Philox4x32-10)."""
    seeds = np.asarray(seeds).astype(np.int64).view(np.uint64)[:, None]
    j = np.arange(vocab, dtype=np.uint64)[None, :]
    word = j % np.uint64(4)  # which rand4x output
    c0 = np.broadcast_to(j // np.uint64(4), (seeds.shape[0], vocab)).copy()
    c1 = np.zeros_like(c0)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0 = np.broadcast_to(seeds & _M32, c0.shape).copy()
    k1 = np.broadcast_to(seeds >> np.uint64(32), c0.shape).copy()
    with np.errstate(over="ignore"):
        for _ in range(10):
            p0 = _PHILOX_ROUND_A * c0  # < 2**64: exact in uint64
            p2 = _PHILOX_ROUND_B * c2
            c0, c1, c2, c3 = ((p2 >> np.uint64(32)) ^ c1 ^ k0, p2 & _M32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _M32)
            k0 = (k0 + _PHILOX_KEY_A) & _M32
            k1 = (k1 + _PHILOX_KEY_B) & _M32
    bits = np.choose(word.astype(np.int64), [c0, c1, c2, c3]).astype(np.uint32).view(np.int32)
    bits = np.where(bits < 0, ~bits, bits)
    return bits.astype(np.float32) * _UNIFORM_SCALE


def gumbel_sample_ref(logits: torch.Tensor, temperature: torch.Tensor, noise_e: torch.Tensor) -> torch.Tensor:
    """Torch reference of gumbel_sample given E = exponential_noise(seeds, V): [B] int64."""
    x = logits.float()
    t = temperature.float()
    scaled = x / torch.where(t > 0, t, torch.ones_like(t))[:, None]
    sampled = (scaled - noise_e.float().log()).argmax(dim=-1)
    return torch.where(t > 0, sampled, x.argmax(dim=-1))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (a bijection of uint64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_seeds(base_seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Per-row Philox seeds: mix a request's seed with the position of the token drawn.

    base_seeds: int64 (taken as two's complement) or uint64; positions: int64; same shape.
    Returns int64 in [0, 2**63): mix64(mix64(seed) + GOLDEN * (position + 1)) >> 1, so a
    seeded request gets a fresh, reproducible stream per output token whatever else is in
    the batch (for a fixed seed, distinct positions collide only through the final >> 1).
    """
    base = np.asarray(base_seeds)
    assert base.dtype in (np.int64, np.uint64), base.dtype
    pos = np.asarray(positions, dtype=np.int64)
    assert base.shape == pos.shape
    with np.errstate(over="ignore"):
        z = _mix64(base.view(np.uint64)) + _GOLDEN * (pos.view(np.uint64) + np.uint64(1))
        return (_mix64(z) >> np.uint64(1)).astype(np.int64)


# ----------------------------------------------------------------------------- kernels

if HAS_TRITON:

    @triton.jit
    def _uniform_tile(seed, col0, BLOCK: tl.constexpr):
        """u for columns col0 + [0, BLOCK) (col0 % 4 == 0): word j % 4 of rand4x(seed, j // 4)."""
        u0, u1, u2, u3 = tl.rand4x(seed, col0 // 4 + tl.arange(0, BLOCK // 4))
        # [i, a, b] = u_{2a+b}, so the flat index 4i + 2a + b is column col0 + 4i + (2a + b)
        return tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), [BLOCK])

    # the int arguments change with the batch size: unspecialized, one compiled variant
    @triton.jit(do_not_specialize=["vocab", "num_tiles", "tiles_per_chunk", "num_chunks"])
    def _gumbel_partial_kernel(
        logits_ptr,
        temp_ptr,
        seed_ptr,
        pval_ptr,
        pidx_ptr,
        stride_l,
        vocab,
        num_tiles,
        tiles_per_chunk,
        num_chunks,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_l
        t = tl.load(temp_ptr + row).to(tl.float32)
        tile0 = chunk * tiles_per_chunk
        tile1 = tl.minimum(tile0 + tiles_per_chunk, num_tiles)
        lanes = tl.arange(0, BLOCK)
        best_v = tl.full([BLOCK], float("-inf"), tl.float32)
        # the chunk's first column: what an all -inf chunk reports (torch.argmax gives 0)
        best_i = tl.zeros([BLOCK], tl.int32) + tile0 * BLOCK
        # per lane running max; strict > keeps a lane's lowest column on ties, NaN never wins
        if t > 0:
            seed = tl.load(seed_ptr + row)
            for tile in range(tile0, tile1):
                cols = tile * BLOCK + lanes
                x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
                u = _uniform_tile(seed, tile * BLOCK, BLOCK)
                score = tl.math.div_rn(x.to(tl.float32), t) - tl.log(-tl.log(u))
                upd = score > best_v
                best_v = tl.where(upd, score, best_v)
                best_i = tl.where(upd, cols, best_i)
        else:
            for tile in range(tile0, tile1):
                cols = tile * BLOCK + lanes
                x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
                x = x.to(tl.float32)
                upd = x > best_v
                best_v = tl.where(upd, x, best_v)
                best_i = tl.where(upd, cols, best_i)
        m = tl.max(best_v, 0)
        idx = tl.min(tl.where(best_v == m, best_i, 2147483647), 0)
        out = row * num_chunks + chunk
        tl.store(pval_ptr + out, m)
        tl.store(pidx_ptr + out, idx)

    @triton.jit(do_not_specialize=["num_chunks"])
    def _argmax_reduce_kernel(pval_ptr, pidx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_C)
        mask = offs < num_chunks
        v = tl.load(pval_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
        i = tl.load(pidx_ptr + row * num_chunks + offs, mask=mask, other=2147483647)
        m = tl.max(v, 0)
        idx = tl.min(tl.where(mask & (v == m), i, 2147483647), 0)
        tl.store(out_ptr + row, idx.to(tl.int64))

    @triton.jit
    def _exp_noise_kernel(seed_ptr, out_ptr, stride_o, vocab, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        col0 = tl.program_id(1) * BLOCK
        seed = tl.load(seed_ptr + row)
        cols = col0 + tl.arange(0, BLOCK)
        e = -tl.log(_uniform_tile(seed, col0, BLOCK))
        tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, e, mask=cols < vocab)


def _num_chunks(b: int, num_tiles: int, device: torch.device) -> int:
    """Chunks per row: about PROGRAMS_PER_SM programs per SM in total, at most one wave.

    Philox (~100 integer ops per rand4x call, i.e. ~25 per column) plus two logs and a
    division per column make the sampling kernel compute-bound (~40 ops per 2-byte logit),
    so the grid should cover every SM; at 4 warps a program, 8 per SM is half occupancy,
    enough to hide the loads. Rounding down keeps B * C within one wave (B=256 on
    132 SMs: C = 4, 1024 programs of ~38 tiles each); small batches split rows finer (B=1:
    one tile per program). Untuned: the `num_chunks` argument overrides it.
    """
    target = PROGRAMS_PER_SM * num_sms(device)
    return max(1, min(num_tiles, target // max(b, 1), MAX_CHUNKS))


def gumbel_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    num_chunks: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sample one token per row: argmax(logits / T + Gumbel(seeds)) or argmax(logits) if T <= 0.

    logits: [B, V] bf16/fp16/fp32 (last dim contiguous, any row stride); temperature: [B]
    fp32; seeds: [B] int64 (see row_seeds). Returns [B] int64 (written into `out` if given).
    No host sync, so it can be captured in a CUDA graph.
    """
    require_triton()
    assert logits.dim() == 2 and logits.stride(-1) == 1, "logits: [B, V], last dim contiguous"
    assert logits.dtype in (torch.bfloat16, torch.float16, torch.float32), logits.dtype
    b, v = logits.shape
    assert 0 < v <= _INT32_MAX - BLOCK
    assert temperature.shape == (b,) and temperature.dtype == torch.float32
    assert seeds.shape == (b,) and seeds.dtype == torch.int64
    assert temperature.is_contiguous() and seeds.is_contiguous()
    assert temperature.device == logits.device and seeds.device == logits.device
    if out is None:
        out = torch.empty(b, dtype=torch.int64, device=logits.device)
    assert out.shape == (b,) and out.dtype == torch.int64 and out.is_contiguous()
    if b == 0:
        return out
    num_tiles = triton.cdiv(v, BLOCK)
    c = num_chunks if num_chunks is not None else _num_chunks(b, num_tiles, logits.device)
    assert c >= 1
    per_chunk = triton.cdiv(num_tiles, min(c, num_tiles, MAX_CHUNKS))
    c = triton.cdiv(num_tiles, per_chunk)  # no empty chunks
    pval = torch.empty(b, c, dtype=torch.float32, device=logits.device)
    pidx = torch.empty(b, c, dtype=torch.int32, device=logits.device)
    _gumbel_partial_kernel[(b, c)](
        logits, temperature, seeds, pval, pidx, logits.stride(0), v, num_tiles, per_chunk, c, BLOCK=BLOCK, num_warps=4
    )
    _argmax_reduce_kernel[(b,)](pval, pidx, out, c, BLOCK_C=MAX_CHUNKS, num_warps=1)
    return out


def exponential_noise(
    seeds: torch.Tensor, vocab: int, device: torch.device | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """E [B, vocab] fp32, E = -log(u) with the same u as gumbel_sample for these seeds."""
    require_triton()
    device = seeds.device if device is None else torch.device(device)
    assert seeds.dim() == 1 and seeds.dtype == torch.int64
    assert 0 < vocab <= _INT32_MAX - NOISE_BLOCK
    seeds = seeds.to(device).contiguous()
    b = seeds.shape[0]
    if out is None:
        out = torch.empty(b, vocab, dtype=torch.float32, device=device)
    assert out.shape == (b, vocab) and out.dtype == torch.float32 and out.stride(-1) == 1
    if b:
        _exp_noise_kernel[(b, triton.cdiv(vocab, NOISE_BLOCK))](
            seeds, out, out.stride(0), vocab, BLOCK=NOISE_BLOCK, num_warps=4
        )
    return out


__all__ = ["gumbel_sample", "gumbel_sample_ref", "exponential_noise", "philox_uniform_ref", "row_seeds"]
