"""What the scheduler hands the executor for one step: the scheduled sequences and their token
counts, the blocks to copy (copy-on-write), the blocks registered at scheduling, and the copies
between the GPU pool and the host tier (engine/host_tier.py). The executor runs the step's
offloads, then its loads, then its copy-on-write copies, then its forward, in that order; its
prefetch loads (read from the next step on) run beside the forward, and the next step waits for them.

A plain message module that the scheduler (which fills it) and the executors (which run it)
both import, so neither imports the other (as vLLM v1's `sched/output.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.engine.block_pool import Block
from pagedllm.engine.sequence import Sequence

if TYPE_CHECKING:
    from pagedllm.engine.beam_search import BeamSearch

PLACEHOLDER = -1  # a sampled token whose id has not reached the host yet (async scheduling)


@dataclass(slots=True)  # one per scheduled sequence per step: slots make it cheaper to build and read
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    forks: list[Sequence] = field(default_factory=list)  # children forked at this step: they sample from seq's row
    # speculative decoding (spec_decode.py): proposals verified this step, the step's inputs after the
    # last token; the step samples 1 + len(spec_token_ids) rows for seq (none of them in token_ids)
    spec_token_ids: list[int] = field(default_factory=list)
    # set by Scheduler.advance() at launch
    sampled: bool = False
    computed_after: int = 0
    placeholder_index: int = -1

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last token, so a new one is sampled."""
        seq = self.seq
        return seq.num_computed_tokens + self.num_new_tokens == len(seq.token_ids) + len(self.spec_token_ids)

    @property
    def sample_seqs(self) -> list[Sequence]:
        """The sequences that draw a token from this row's logits (when it samples), in row order."""
        return [self.seq, *self.forks] if self.forks else [self.seq]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0
    new_cached: list[Block] = field(default_factory=list)  # registered at scheduling: uncached if it never runs
    blocks_to_offload: list[tuple[int, int]] = field(default_factory=list)  # (GPU block, host block)
    blocks_to_load: list[tuple[int, int]] = field(default_factory=list)  # (host block, GPU block)
    # loads of sequences admitted for the next step (Scheduler._prefetch): they run beside this forward
    blocks_to_prefetch: list[tuple[int, int]] = field(default_factory=list)
    new_host_cached: list[Block] = field(default_factory=list)  # host blocks its offloads registered
    finished_searches: list[BeamSearch[Sequence]] = field(
        default_factory=list
    )  # set by resolve: beam searches that ended
    step_id: int = 0  # the core's step number, when a timeline records it (timeline.py)
    num_rejected_tokens: int = 0  # set by resolve: sample rows whose token was not emitted (rejected, or past a stop)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_decode_only(self) -> bool:
        return all(s.num_new_tokens == 1 for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)
