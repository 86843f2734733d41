"""Programmatic dependent launch (PDL, Hopper and later): a decode step's kernels start while the
kernel before them finishes.

In a decode step of a few rows every kernel is short: a GEMM reads a 4-12 MB weight in 5-6 us inside
a CUDA graph, most of it launch and ramp (Benchmarks, Decode GEMM), and each kernel starts only after
the previous one has finished and flushed its writes. A kernel launched with PDL (`launch_pdl=True`)
may start as soon as every program of the previous kernel has signalled (`gdc_launch_dependents`,
which these kernels call once a program's main loop is done). It must then wait (`gdc_wait`) before
it reads anything an earlier kernel wrote and before it writes anything; what it does before the
wait is what overlaps the previous kernel: the decode GEMM pulls its share of the weight into L2
(`prefetch_l2`), memory no kernel of a step writes.

The rule that keeps a chain of them ordered: every kernel launched with PDL waits before its first
dependent load and its first store, and signals only after that wait. So a kernel two launches on
starts only after the one before it has signalled, which that one does only after the kernel before
it has finished: at most the weight prefetches of one kernel run beside the kernel before.

PAGEDLLM_PDL=1 turns it on (off by default until measured on a GPU); `enabled` also needs compute
capability >= 9 and a probe (`_probe`, once per device, before any graph is captured: the model
runner calls `enabled` at start-up) in which a chain of PDL launches replayed from a CUDA graph
counts right. Kernels take `USE_PDL` as a constexpr, so the code without PDL is what it was.
"""

from __future__ import annotations

import logging

import torch

from pagedllm import envs
from pagedllm.ops._triton import HAS_TRITON, is_interpreted, tl, triton

logger = logging.getLogger("pagedllm")

_PROBED: dict[int, bool] = {}  # device index -> whether PDL works there (the probe's result)
PROBE_CHAIN = 32  # launches in the probe's graph


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: PAGEDLLM_PDL=1, a CUDA device of compute capability
    >= 9, compiled kernels, and the probe passed. Never probes while a graph is being captured."""
    if device.type != "cuda" or not HAS_TRITON or not envs.pdl() or is_interpreted(_probe_kernel):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROBED:
        if torch.cuda.is_current_stream_capturing():
            return False
        _PROBED[index] = torch.cuda.get_device_capability(index)[0] >= 9 and _probe(index)
    return _PROBED[index]


def launch_options(use_pdl: bool) -> dict[str, bool]:
    """The launch keywords of a kernel launched with or without PDL (none without: the interpreter
    and older Triton builds take no `launch_pdl`)."""
    return {"launch_pdl": True} if use_pdl else {}


def _probe(index: int) -> bool:
    """A chain of PROBE_CHAIN increments of one buffer, each launched with PDL, captured in a CUDA
    graph and replayed three times: every element must count 3 * PROBE_CHAIN."""
    try:
        with torch.cuda.device(index):
            x = torch.zeros(256, dtype=torch.int32, device="cuda")
            _probe_kernel[(2,)](x, USE_PDL=True, **launch_options(True))  # compile outside the capture
            torch.cuda.synchronize()
            x.zero_()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(PROBE_CHAIN):
                    _probe_kernel[(2,)](x, USE_PDL=True, **launch_options(True))
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            ok = bool((x == 3 * PROBE_CHAIN).all())
    except Exception as e:  # an older driver or Triton build: run without PDL
        logger.warning("PAGEDLLM_PDL=1, but PDL launches failed on cuda:%d (%r): running without", index, e)
        return False
    if not ok:
        logger.warning("PAGEDLLM_PDL=1, but a PDL chain miscounted on cuda:%d: running without", index)
    return ok


if HAS_TRITON:

    @triton.jit
    def _probe_kernel(x_ptr, USE_PDL: tl.constexpr):
        offs = tl.program_id(0) * 128 + tl.arange(0, 128)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptr + offs)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(x_ptr + offs, x + 1)

    @triton.jit
    def prefetch_l2(ptrs, mask):
        """Ask for the 128-byte lines at `ptrs` (where `mask`) to be brought into L2; no result."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r",
            [ptrs, mask.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
