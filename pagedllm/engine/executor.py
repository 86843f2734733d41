"""The contract between LLMEngine and whatever runs the model (ModelRunner, TPExecutor, a test fake).

The engine decides; the executor computes. `execute` runs one SchedulerOutput and returns its
StepResult: one sampled token id per sample row, in row order (for each scheduled sequence that
samples: the sequence, then the children it forks this step, `ScheduledSequence.sample_seqs`),
and the logprobs of the rows and prompts that asked for them. An executor with `supports_async`
also offers `execute_async`, which launches the step and returns at once; the handle's `result()`
blocks until the result is on the host (async scheduling, docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from pagedllm.engine.kv_cache_groups import KVCacheGroup
    from pagedllm.engine.scheduler import SchedulerOutput


class TokenLogprobs(NamedTuple):
    """One scored token: `token_ids[0]` is the token itself (sampled, or the prompt's next token),
    `token_ids[1:]` the top k of the distribution, best first; `logprobs` the log-softmax of the
    model's raw float32 logits at those ids; `rank` the token's rank (1 = the most likely; ties
    count against it: the number of ids whose logprob is >= its own)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class PromptLogprobsChunk:
    """Prompt logprobs a step computed for one sequence: entry j scores prompt token `start + j`
    (start >= 1: the first prompt token has no logprob), given the tokens before it."""

    start: int
    entries: list[TokenLogprobs]


@dataclass
class StepResult:
    sampled: list[int]  # one per sample row
    logprobs: list[TokenLogprobs | None] | None = None  # per sample row (None: that row did not ask); None: none did
    prompt_logprobs: dict[int, PromptLogprobsChunk] | None = None  # seq_id -> this step's chunk


class StepHandle(Protocol):
    def result(self) -> StepResult: ...


class Executor(Protocol):
    @property
    def num_kv_blocks(self) -> int: ...

    @property
    def kv_cache_dtype(self) -> str:
        """The KV storage format as resolved: "bfloat16", "float32", "fp8_e4m3", ... (config.RESOLVED_KV_CACHE_DTYPES)."""
        ...

    @property
    def kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        """The model's layers grouped by attention kind (kv_cache_groups.py): one group per set of
        block tables the executor reads; a model of one kind has one."""
        ...

    @property
    def supports_async(self) -> bool: ...

    def execute(self, scheduler_output: SchedulerOutput) -> StepResult: ...

    def execute_async(self, scheduler_output: SchedulerOutput) -> StepHandle: ...

    def close(self) -> None: ...
