"""StepHandle: what ModelRunner.execute_async returns (engine/executor.py's StepHandle)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.engine.step_result import StepResult
from pagedllm.worker.logprobs import PromptLogprobs, SampleLogprobs

# the step's host-tier loads: seconds (CPU), or CUDA events around them, read once the step is done
LoadTime = float | tuple[torch.cuda.Event, torch.cuda.Event]


@dataclass
class LaunchedStep:
    """What a launched step left on the device: the sampled ids (None: nothing sampled, or a
    tensor-parallel rank other than 0), the logprobs asked for (None: none asked) and the time
    of its host-tier loads."""

    sampled: torch.Tensor | None
    logprobs: SampleLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    load_time: LoadTime = 0.0


class StepHandle:
    """The results of a launched step: device-to-host copies (the ids into pinned memory) queued
    behind the step's kernels, waited for only in result()."""

    def __init__(self, step: LaunchedStep, host_buffers: list[torch.Tensor]):
        sampled, prompt = step.sampled, step.prompt_logprobs
        self.logprobs = None if step.logprobs is None else step.logprobs.to_host()
        self.prompt_logprobs = None if prompt is None or prompt.scored is None else prompt.to_host()
        if sampled is None:
            self.host, self.n = None, 0
        elif sampled.is_cuda:
            host_buffers.append(host_buffers.pop(0))  # alternate: the previous step's is still being read
            self.host, self.n = host_buffers[-1], sampled.numel()
            self.host[: self.n].copy_(sampled, non_blocking=True)
        else:
            self.host, self.n = sampled, sampled.numel()
        on_cuda = (sampled is not None and sampled.is_cuda) or (
            prompt is not None and prompt.scored is not None and prompt.scored.token_ids.is_cuda
        )
        self.load_time = step.load_time
        self.event = torch.cuda.Event() if on_cuda or isinstance(step.load_time, tuple) else None
        if self.event is not None:
            self.event.record()  # after every copy above

    def result(self) -> StepResult:
        if self.event is not None:
            self.event.synchronize()
        load = self.load_time
        if isinstance(load, tuple):
            load[1].synchronize()  # prefetch loads may end after the step
        return StepResult(
            [] if self.host is None else self.host[: self.n].tolist(),
            None if self.logprobs is None else self.logprobs.entries(),
            None if self.prompt_logprobs is None else self.prompt_logprobs.chunks(),
            load[0].elapsed_time(load[1]) / 1e3 if isinstance(load, tuple) else load,
        )
