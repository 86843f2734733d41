"""Which CUDA graphs a ModelRunner captures at start-up (none when it runs eagerly).

Decode steps replay DecodeGraphs (cuda_graphs.py). PAGEDLLM_PREFILL_GRAPHS (envs.py) picks the
rest: "full" also captures whole small prefill and mixed steps, one replay each (mixed_graphs.py;
not for a model with MoE blocks), and "full" or "piecewise" captures the layers between the
attention calls for steps of up to PIECEWISE_MAX_TOKENS tokens (piecewise_graphs.py); "eager"
captures neither. ModelRunner.forward tries them in that order and runs eagerly what none holds.

No Python garbage collection runs while they are captured: torch.cuda.graph no longer collects
before a capture (torch.compiler.config.force_cudagraph_gc), so an earlier engine's CUDA graphs,
left in a reference cycle in the same process, could be destroyed by a collection that starts in
the middle of a capture, which invalidates it ("operation not permitted when stream is
capturing"). One collection first frees them while nothing is captured; collection is then off
until the captures end.

The graphs' memory is not in the KV sizing (they are captured over the allocated KV): it comes
from what gpu_memory_utilization leaves free. A capture that runs out of it fails with an error
that names the settings to change (explain_capture_oom), not a bare CUDA out-of-memory.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from pagedllm import envs
from pagedllm.engine.startup_times import StartupTimes
from pagedllm.model.moe import SparseMoeBlock

if TYPE_CHECKING:
    from pagedllm.worker.cuda_graphs import DecodeGraphs
    from pagedllm.worker.mixed_graphs import MixedGraphs
    from pagedllm.worker.piecewise_graphs import PiecewiseGraphs
    from pagedllm.worker.runner_view import GraphRunner

# steps of more tokens run eagerly: their launch cost is small beside their device time, and
# each bucket is L + 1 graphs captured at start-up
PIECEWISE_MAX_TOKENS = 8192


def capture_graphs(
    runner: GraphRunner, startup: StartupTimes
) -> tuple[DecodeGraphs, MixedGraphs | None, PiecewiseGraphs | None]:
    """(decode graphs, whole-step graphs, piecewise graphs), each capture timed as a start-up phase."""
    from pagedllm.worker.cuda_graphs import DecodeGraphs
    from pagedllm.worker.mixed_graphs import MixedGraphs
    from pagedllm.worker.piecewise_graphs import PiecewiseGraphs

    mixed: MixedGraphs | None = None
    piecewise: PiecewiseGraphs | None = None
    with no_collection_while_capturing():
        with startup.phase("decode graphs"):
            graphs = DecodeGraphs(runner)
        mode = envs.prefill_graphs()
        if mode == "full" and not any(isinstance(m, SparseMoeBlock) for m in runner.model.modules()):
            with startup.phase("whole-step graphs"):
                mixed = MixedGraphs(runner)  # small prefill and mixed steps: one replay each
        if mode in ("full", "piecewise"):
            with startup.phase("piecewise graphs"):
                piecewise = PiecewiseGraphs(runner, min(runner.max_num_batched_tokens, PIECEWISE_MAX_TOKENS))
    return graphs, mixed, piecewise


@contextmanager
def no_collection_while_capturing() -> Iterator[None]:
    """One garbage collection now, none until the block ends (the module docstring says why);
    collection is left as it was found (a caller may have turned it off itself)."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def explain_capture_oom(gpu_memory_utilization: float, kv_cache_bytes: int, sizing: str) -> Iterator[None]:
    """An out-of-memory error inside the block (or one a failed capture raised on top of it)
    becomes a ValueError naming what to change; sizing: how the KV cache was sized."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as e:
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, torch.OutOfMemoryError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise ValueError(
            f"capturing CUDA graphs ran out of GPU memory after the KV cache took {kv_cache_bytes / 2**30:.2f} GiB "
            f"({sizing}): lower gpu_memory_utilization (now {gpu_memory_utilization}), kv_cache_memory_bytes or "
            "num_kv_blocks, or max_num_seqs / max_num_batched_tokens, or pass enforce_eager=True"
        ) from e
