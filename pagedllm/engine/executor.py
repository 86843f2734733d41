"""The contract between LLMEngine and whatever runs the model (ModelRunner, TPExecutor, a test fake).

The engine decides; the executor computes. `execute` runs one SchedulerOutput and returns one
sampled token id per scheduled sequence that samples, in scheduled order. An executor with
`supports_async` also offers `execute_async`, which launches the step and returns at once; the
handle's `result()` blocks until the ids are on the host (async scheduling, ARCHITECTURE.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pagedllm.engine.scheduler import SchedulerOutput


class StepHandle(Protocol):
    def result(self) -> list[int]: ...


class Executor(Protocol):
    @property
    def num_kv_blocks(self) -> int: ...

    @property
    def supports_async(self) -> bool: ...

    def execute(self, scheduler_output: SchedulerOutput) -> list[int]: ...

    def execute_async(self, scheduler_output: SchedulerOutput) -> StepHandle: ...

    def close(self) -> None: ...
