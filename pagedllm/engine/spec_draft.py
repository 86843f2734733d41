"""Draft-model speculative decoding, the engine's side: the contract with the executor that runs
the draft model (Drafter), and filling a scheduled step's proposals in before it runs.

The scheduler decides how many proposals a sequence verifies (spec_decode.Speculator: the same
bounds as n-gram proposals, PLACEHOLDER ids); the executor's draft model decides which. Before
each step the core calls `fill_drafts`: the draft runs over the step's tokens and returns its
greedy proposals, which replace the placeholders; from there the step is an n-gram verification
step like any other (spec_verify.py), and as exact: a greedy proposal is a point mass.

The draft's KV is kept in step with the target's by the worker (worker/draft_model.py): its own
KV tensor has the target pool's block count and block size and is indexed by the target's block
tables, and before it proposes for a sequence it catches up over that sequence's tokens its KV
does not hold yet. The engine keeps no draft state at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from pagedllm.engine.scheduler_output import PLACEHOLDER

if TYPE_CHECKING:
    from pagedllm.engine.scheduler_output import SchedulerOutput
    from pagedllm.engine.spec_config import SpeculativeConfig


@runtime_checkable
class Drafter(Protocol):
    def propose_drafts(self, out: SchedulerOutput) -> list[int]:
        """Run the draft model over the step's tokens (writing its KV where the target's goes) and
        return, for each scheduled sequence with proposals, in scheduled order, as many greedy
        proposals as it has PLACEHOLDERs, concatenated. Called before the step's execute."""
        ...


def drafter_of(executor: object, spec: SpeculativeConfig | None) -> Drafter | None:
    """The executor as a Drafter when speculation uses a draft model (else None)."""
    if spec is None or not spec.uses_draft_model:
        return None
    if not isinstance(executor, Drafter):
        raise TypeError(f"{type(executor).__name__} cannot run a draft model (speculative_config.model)")
    return executor


def fill_drafts(out: SchedulerOutput, drafter: Drafter) -> None:
    """Replace the step's PLACEHOLDER proposals with the draft model's."""
    ids = drafter.propose_drafts(out)
    i = 0
    for s in out.scheduled:
        if s.spec_token_ids:
            k = len(s.spec_token_ids)
            assert all(t == PLACEHOLDER for t in s.spec_token_ids), s.spec_token_ids
            s.spec_token_ids = ids[i : i + k]
            i += k
    assert i == len(ids), (i, len(ids))
