"""Typed messages between the API side (AsyncLLM, the server) and the engine core.

They cross a process boundary (pickled over a pipe, ARCHITECTURE.md), so they hold plain data
only: ids, numbers, strings, SamplingParams.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.engine.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """A checked request (InputProcessor.process made it): the core queues it without re-validating."""

    request_id: str
    prompt: str | None  # the text, when the prompt was one (outputs echo it); the core ignores it
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic(): one clock for every process of a host
