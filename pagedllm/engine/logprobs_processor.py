"""The engine core's TokenLogprobs -> vLLM's logprobs shapes (outputs.py), built lazily.

The core sends one TokenLogprobs per new token of a sequence that asks (SamplingParams
.sample_logprobs) and, once, the prompt's. Per token only the raw entry is kept and the running
cumulative logprob updated (one float add); the dicts of Logprob, with each token's text, are
built when an output is made and only for the tokens no output has carried yet.

A dict for one position: the token at that position first (its own rank), then the top k in
order (ranks 1..k), skipping the token itself when it is among them: k + 1 entries, or k.
"""

from __future__ import annotations

from pagedllm.engine.detokenizer import Decoder
from pagedllm.engine.outputs import Logprob, PromptLogprobs, SampleLogprobs
from pagedllm.engine.step_result import TokenLogprobs


class TokenTexts:
    """A token id's text alone (decode of that one id, special tokens kept, as vLLM shows them),
    decoded once per id for the processor's life: at most one string per vocabulary entry."""

    def __init__(self, decoder: Decoder | None):
        self.decoder = decoder
        self.texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.decoder is None:
            return None
        text = self.texts.get(token_id)
        if text is None:
            text = self.texts[token_id] = self.decoder.decode([token_id], skip_special_tokens=False)
        return text


def logprob_dict(entry: TokenLogprobs, texts: TokenTexts) -> dict[int, Logprob]:
    ids, lps = entry.token_ids, entry.logprobs
    token = ids[0]
    out = {token: Logprob(lps[0], entry.rank, texts(token))}
    for rank, (tid, lp) in enumerate(zip(ids[1:], lps[1:], strict=True), start=1):
        if tid != token:
            out[tid] = Logprob(lp, rank, texts(tid))
    return out


def prompt_logprobs_of(entries: list[TokenLogprobs], texts: TokenTexts) -> PromptLogprobs:
    """One entry per prompt token: None for the first (nothing precedes it), then entry j - 1
    (which scores prompt token j) as a dict."""
    out: PromptLogprobs = [None]
    out += [logprob_dict(e, texts) for e in entries]
    return out


class SampleLogprobsState:
    """One sequence's logprobs: `raw` has one entry per token id the sequence kept, in order.
    `shown` is False when only best_of asked (k = 0, for the cumulative logprob): then no dicts
    are ever built and the output's `logprobs` is None."""

    __slots__ = ("raw", "cumulative", "shown", "built")

    def __init__(self, shown: bool):
        self.raw: list[TokenLogprobs] = []
        self.cumulative = 0.0  # sum of raw[i].logprobs[0]
        self.shown = shown
        self.built: SampleLogprobs = []  # dicts of raw[: len(built)]

    def extend(self, entries: list[TokenLogprobs]) -> None:
        self.raw += entries
        for e in entries:
            self.cumulative += e.logprobs[0]

    def truncate(self, num_tokens: int) -> None:
        """A stop string cut the sequence to its first num_tokens tokens."""
        if num_tokens < len(self.raw):
            del self.raw[num_tokens:]
            del self.built[num_tokens:]
            self.cumulative = sum(e.logprobs[0] for e in self.raw)

    def output(self, texts: TokenTexts) -> SampleLogprobs | None:
        """Every position's dict so far (a new list: a later output must not change this one)."""
        if not self.shown:
            return None
        built = self.built
        if len(built) < len(self.raw):
            built += [logprob_dict(e, texts) for e in self.raw[len(built) :]]
        return list(built)
