"""The contract between LLMEngine and whatever runs the model (ModelRunner, TPExecutor, a test fake).

The engine decides; the executor computes. `execute` runs one SchedulerOutput and returns its
StepResult: one sampled token id per sample row, in row order (for each scheduled sequence that
samples: the sequence, then the children it forks this step, `ScheduledSequence.sample_seqs`),
and the logprobs of the rows and prompts that asked for them. An executor with `supports_async`
also offers `execute_async`, which launches the step and returns at once; the handle's `result()`
blocks until the result is on the host (async scheduling, docs/architecture.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pagedllm.engine.step_result import PromptLogprobsChunk, StepResult, TokenLogprobs

if TYPE_CHECKING:
    from pagedllm.engine.kv_cache_groups import KVCacheGroup
    from pagedllm.engine.scheduler_output import SchedulerOutput

__all__ = ["Executor", "PromptLogprobsChunk", "StepHandle", "StepResult", "TokenLogprobs"]


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
