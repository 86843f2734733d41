"""RequestOutput / CompletionOutput, shaped as vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's entry in a logprobs dict (vLLM's Logprob): log-softmax of the raw logits,
    its rank in the distribution (1 = the most likely) and its text alone (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per position, token id -> Logprob: the token at that position first, then the top k (k+1
# entries, or k when the token is among the top k)
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # the first prompt token's entry is None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (when logprobs or best_of)
    logprobs: SampleLogprobs | None = None  # one entry per token of token_ids (SamplingParams.logprobs set)
    score: float | None = None  # beam search: cumulative_logprob / len(token_ids) ** length_penalty
    error: str | None = None  # finish_reason "error": why the request could not run
    # streaming: what this step added
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None  # one entry per prompt token (SamplingParams.prompt_logprobs set)


@dataclass
class BeamSearchSequence:
    """One returned beam (vLLM's BeamSearchSequence): `tokens` and `text` are the prompt's and
    the output's together, as vLLM's; `output_token_ids` / `output_text` the generated part."""

    tokens: list[int]
    text: str
    output_token_ids: list[int]
    output_text: str
    cum_logprob: float
    score: float
    finish_reason: str | None = None  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best (highest score) first."""

    sequences: list[BeamSearchSequence]
