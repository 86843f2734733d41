"""Typed messages between the API side (AsyncLLM, the server) and the engine core.

They cross a process boundary (pickled over a pipe, docs/architecture.md), so they hold plain data
only: ids, numbers, strings, SamplingParams, an InvalidRequestError. Readers use the fields by
name; nothing is a positional tuple.

    API -> core    EngineCoreRequest          a checked request (InputProcessor.process made it)
                   Abort(request_ids)         finish these now, wherever they are
                   StopSequences(sequences)   these (request id, index) hit a stop string
                   Shutdown()                 abort everything, answer Bye, exit
    core -> API    Ready(info)                once the model is loaded
                   StartupError(error)        instead of Ready when start-up fails
                   Step(outputs, stats)       per step: every sequence that got a token
                   Stats(stats)               on going idle (the gauges drop to 0 at once)
                   Rejected(request_id, error) the core refused a request (InvalidRequestError)
                   Failed(request_ids, message) a step raised; those requests are gone
                   Bye()                      after Shutdown, before exit

`request_id` on the wire is the id the API side gave the core (AsyncLLM's internal id, never
reused), so an output still in flight for an aborted request can never be taken for a later one's.
Times are time.monotonic(), one clock for every process of a host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.kv_cache_groups import KVCacheGroup
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.step_result import TokenLogprobs

Metrics = dict[str, Any]  # LLMEngine.get_metrics(): gauges and counters by name


@dataclass
class EngineCoreRequest:
    """A checked request (InputProcessor.process made it): the core queues it without re-validating."""

    request_id: str
    prompt: str | None  # the text, when the prompt was one (outputs echo it); the core ignores it
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic(): one clock for every process of a host


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step did to one sequence: the token ids it got and, once, how it ended.

    `index` is the sequence's place in its request (0 .. num_samples - 1). `finish_reason` is
    "stop" (EOS or a stop token id, which is then `stop_reason`) or "length"; stop strings are the
    output processor's business, the core never sees text. `new_logprobs` has one entry per new
    token when the sequence's params ask for logprobs (SamplingParams.sample_logprobs), else None;
    `prompt_logprobs` is sent once, with the request's first token of index 0: one entry per
    prompt token after the first."""

    request_id: str
    index: int
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    first_token_time: float | None = None
    finish_time: float | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    # beam search: a request's outputs come once, at the end, one per returned beam (index = rank,
    # new_token_ids = all its output tokens) with its cumulative logprob and score
    cumulative_logprob: float | None = None
    score: float | None = None
    # finished by an EOS or stop token id: the output processor leaves that token's text out
    # (unless include_stop_str_in_output); a grammar that completes on a token of its own shows it
    stop_token: bool = False
    # finish_reason "error": why (a grammar that failed to compile in the core); None otherwise
    error: str | None = None

    def __reduce__(self) -> tuple[type[EngineCoreOutput], tuple[Any, ...]]:
        return (EngineCoreOutput, _row(self))


def _row(o: EngineCoreOutput) -> tuple[Any, ...]:
    """The fields in order: what crosses the pipe for one output."""
    return (
        o.request_id,
        o.index,
        o.new_token_ids,
        o.finish_reason,
        o.stop_reason,
        o.num_cached_tokens,
        o.first_token_time,
        o.finish_time,
        o.new_logprobs,
        o.prompt_logprobs,
        o.cumulative_logprob,
        o.score,
        o.stop_token,
        o.error,
    )


@dataclass
class Abort:
    request_ids: list[str]


@dataclass
class StopSequences:
    """These (request id, sequence index) hit a stop string: finish them, and their request once
    it has no other sequence left (EngineCore.stop_sequence). Not an Abort: with n > 1 the
    request's other sequences go on."""

    sequences: list[tuple[str, int]]


@dataclass
class Shutdown:
    pass


@dataclass
class EngineCoreInfo:
    """Sizes the API side needs to check requests as the core would, and the first metrics."""

    pid: int
    model_path: str | None
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    vocab_size: int | None
    max_num_seqs: int  # a request of more samples (n, best_of) could never be scheduled
    max_num_batched_tokens: int = 8192  # with the groups: the blocks one sequence can hold at once
    kv_cache_groups: tuple[KVCacheGroup, ...] = ()
    metrics: Metrics = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()  # the edge compiles grammars with the core's EOS ids


@dataclass
class Ready:
    info: EngineCoreInfo


@dataclass
class StartupError:
    error: BaseException


@dataclass
class Step:
    outputs: list[EngineCoreOutput]
    stats: Metrics | None = None  # at most every STATS_INTERVAL_S (engine_core.py), else None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # on the pipe as plain tuples, one per output: a step carries hundreds, and pickling tuples
        # of ints and strings costs a fraction of pickling as many objects (the engine core's hot path)
        return (_step_from_rows, ([_row(o) for o in self.outputs], self.stats))


def _step_from_rows(rows: list[tuple[Any, ...]], stats: Metrics | None) -> Step:
    return Step([EngineCoreOutput(*row) for row in rows], stats)


@dataclass
class Stats:
    stats: Metrics


@dataclass
class Rejected:
    request_id: str
    error: InvalidRequestError


@dataclass
class Failed:
    request_ids: list[str]
    message: str


@dataclass
class Bye:
    pass


CoreInput = EngineCoreRequest | Abort | StopSequences | Shutdown
CoreEvent = Ready | StartupError | Step | Stats | Rejected | Failed | Bye
