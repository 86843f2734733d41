"""The scheduler's side of beam search: beam_search.py decides, this module acts on the Sequences.

A beam's step returns its top-k instead of a token (keep_beam_result); the beam then has nothing
to compute until every live beam of its request has its result, when the search steps
(next_beams): a beam chosen once is extended in place, one chosen again is forked (it shares the
blocks; copy-on-write on the partial one), one not chosen is dropped. The scheduler
(scheduler.py) runs the forks and frees the dropped beams; nothing here touches its queues.
"""

from __future__ import annotations

from pagedllm.engine.beam_search import BeamSearch
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.engine.step_result import StepResult, TokenLogprobs


def keep_beam_result(
    seq: Sequence, result: StepResult, row: int, now: float, searches: dict[int, BeamSearch[Sequence]]
) -> None:
    """Keep row `row`'s top-k as the beam's result and note its search in `searches` (by id)."""
    if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != seq.num_tokens:
        return  # freed (abort, preempted) after this step launched: it recomputes
    assert result.logprobs is not None and seq.beam is not None
    seq.beam_result = result.logprobs[row]
    if seq.first_token_time is None:
        seq.first_token_time = now
    searches[id(seq.beam)] = seq.beam


def next_beams(search: BeamSearch[Sequence], kv: KVCacheManager) -> tuple[list[Sequence], list[Sequence]]:
    """Every live beam has its top-k: step the search and make its next beams (forks first, from
    the unchanged parents; then the tokens). Returns (the new forks, in order; the parents not
    chosen), for the caller to run and to finish (their blocks are still held)."""
    parents = list(search.beams)
    topk: list[TokenLogprobs] = []
    for b in parents:
        assert b.beam_result is not None  # the caller checked
        topk.append(b.beam_result)
        b.beam_result = None
    survivors = search.step([b.output_token_ids for b in parents], topk)
    beams: list[Sequence] = []
    forks: list[Sequence] = []
    taken: set[int] = set()
    for sv in survivors:
        parent = parents[sv.parent]
        if sv.parent in taken:
            child = parent.fork_child()
            kv.fork(parent, child)
            forks.append(child)
            beams.append(child)
        else:
            taken.add(sv.parent)
            beams.append(parent)
    for beam, sv in zip(beams, survivors, strict=True):
        beam.append_token(sv.token)
    search.beams[:] = beams
    return forks, [p for i, p in enumerate(parents) if i not in taken]
