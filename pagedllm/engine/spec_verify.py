"""Speculative decoding, the verifying half: which tokens a verification step emits, and the KV
rollback of what it rejected (spec_decode.py proposes; the module docstring there says why
comparing the target's own draw with each proposal is exact rejection sampling).

A verification step of a sequence with T tokens (T - 1 computed) and proposals d_1 .. d_k'
writes K/V at positions T - 1 .. T - 1 + k' (the last token, then the proposals) and samples
k' + 1 rows; row j draws x_j after d_1 .. d_j. The accepted run is d_1 .. d_a, the longest
prefix with d_{j+1} == x_j; the step emits x_0 .. x_a (the accepted proposals, then the
target's token at the first mismatch, or the bonus token after all k' were accepted).

KV after the step: positions < T + a hold the KV of the tokens now at those positions (the last
token and the accepted proposals); position T + a holds a rejected proposal's, or nothing. So
the computed length rolls back to T + a (from T + k'), and blocks past it go back to the pool
(KVCacheManager.rollback). No block holding a proposal was findable: the scheduler registers
blocks only up to the sequence's known tokens (KVCacheManager.cache_full_blocks), and proposals
are not among them until accepted, when resolve registers the blocks they complete.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.engine.kv_cache_manager import KVCacheManager
    from pagedllm.engine.sequence import Sequence
    from pagedllm.engine.spec_decode import Speculator


def accepted_run(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verification emits: sampled[0 .. a], a = the leading proposals equal to the
    target's draw at their row (len(sampled) == len(drafts) + 1)."""
    assert len(sampled) == len(drafts) + 1, (drafts, sampled)
    a = 0
    while a < len(drafts) and drafts[a] == sampled[a]:
        a += 1
    return sampled[: a + 1]


def verify(
    seq: Sequence, drafts: list[int], sampled: list[int], kv: KVCacheManager, speculator: Speculator
) -> list[int]:
    """The run `seq` emits from its verification rows; its computed length and blocks rolled back
    past the accepted proposals (call after Scheduler.advance counted all 1 + k' as computed)."""
    run = accepted_run(drafts, sampled)
    num_rejected = len(drafts) - (len(run) - 1)
    speculator.stats.record(len(drafts), len(run) - 1)
    speculator.backoff.record(len(drafts), len(run) - 1)
    kv.rollback(seq, seq.num_computed_tokens - num_rejected)
    return run
