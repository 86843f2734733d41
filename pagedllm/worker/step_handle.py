"""StepHandle: what ModelRunner.execute_async returns (engine/executor.py's StepHandle)."""

from __future__ import annotations

import torch

from pagedllm.engine.executor import StepResult


class StepHandle:
    """The sampled ids of a launched step: one device-to-host copy into pinned memory,
    waited for only in result()."""

    def __init__(self, sampled: torch.Tensor | None, host_buffers: list[torch.Tensor]):
        self.event = None
        if sampled is None:
            self.host, self.n = None, 0
        elif sampled.is_cuda:
            host_buffers.append(host_buffers.pop(0))  # alternate: the previous step's is still being read
            self.host, self.n = host_buffers[-1], sampled.numel()
            self.host[: self.n].copy_(sampled, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.n = sampled, sampled.numel()

    def result(self) -> StepResult:
        if self.event is not None:
            self.event.synchronize()
        return StepResult([] if self.host is None else self.host[: self.n].tolist())
