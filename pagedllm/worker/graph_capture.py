"""Which CUDA graphs a ModelRunner captures at start-up (none when it runs eagerly).

Decode steps replay DecodeGraphs (cuda_graphs.py). PAGEDLLM_PREFILL_GRAPHS (envs.py) picks the
rest: "full" also captures whole small prefill and mixed steps, one replay each (mixed_graphs.py;
not for a model with MoE blocks), and "full" or "piecewise" captures the layers between the
attention calls for steps of up to PIECEWISE_MAX_TOKENS tokens (piecewise_graphs.py); "eager"
captures neither. ModelRunner.forward tries them in that order and runs eagerly what none holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
