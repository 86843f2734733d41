"""The output processor: the engine core's token ids -> text, stop strings, RequestOutputs.

One implementation for every front: LLMEngine (LLM.generate, the CLI) runs it in the engine's
process after each core step; AsyncLLM runs it in the API process on the event loop, where the
core in its own process ships token ids only (docs/architecture.md). Per request a RequestState holds
one SequenceState per sequence the core samples (SamplingParams.num_samples: best_of, or n).

Two halves, so that a consumer may fall behind:
- `process(core_outputs)` as tokens arrive: append ids, record finishes, and match stop strings
  (only those need text this early), so the owner can stop the sequence in the core at once
  (`ProcessedOutputs.stopped`).
- `make_output(state)` when someone asks: decode what is new and build one RequestOutput with
  everything since the last one (cumulative `text` / `token_ids`, `delta_text` / `delta_token_ids`).

Invariants:
- every token id is fed to its sequence's detokenizer once (`num_decoded`), in order; a request
  that is not streamed and has no stop strings is decoded once, when it is first asked for after
  it finished.
- text handed out is never taken back: while a stop string may still complete, the last
  (longest stop string - 1) characters are held back from `delta_text`.
- output switches (SamplingParams): `detokenize` False: no text at all (""); skip_special_tokens
  and spaces_between_special_tokens choose the request's decoder (detokenizer.py).
- a sequence that stops on a stop token or EOS (`EngineCoreOutput.stop_token`) keeps that token's id but not its text, unless include_stop_str_in_output (vLLM's
  rule): the token is never fed to the detokenizer (`SequenceState.hide_last`).
- stop strings: not before min_tokens output tokens, not on the token that finished the sequence
  anyway (EOS, stop token, length), searched only where the newest token's text can complete one;
  on a hit the text is cut before it (after it with include_stop_str_in_output, which then
  holds nothing back), later tokens are dropped, finish_reason "stop" and
  stop_reason the string.
- the detokenizer is flushed (an incomplete character at the very end) when a sequence finishes
  by EOS, stop token or length; not after a stop string (the text is cut) or an abort.
- logprobs (logprobs_processor.py): a sequence that asks keeps one raw entry per token id it
  keeps (a stop string's cut drops both), so `CompletionOutput.logprobs` always has
  len(token_ids) entries and a streamed output's new ones are its last len(delta_token_ids);
  the dicts and their texts are built by make_output, for the new positions only. Requests that
  ask for no logprobs pay one attribute test per token.
- beam search: the core sends each returned beam once, finished, best first (index = rank),
  with its cumulative logprob and score; such a request is never streamed either.
- best_of > n: the request samples best_of sequences and has no partial outputs (it is never
  streamed, whatever `stream` says): its one output, when every sequence has finished, holds the
  n with the highest cumulative logprob, best first (ties: the lower index), re-indexed 0..n-1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.detokenizer import Decoder, IncrementalDetokenizer, SpacedDecoder, fast_decoder, special_ids_of
from pagedllm.engine.logprobs_processor import SampleLogprobsState, TokenTexts, prompt_logprobs_of
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.engine.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.step_result import TokenLogprobs


@dataclass
class SequenceState:
    index: int
    detok: IncrementalDetokenizer | None  # None: text is decoded once, at the end (or never)
    token_ids: list[int] = field(default_factory=list)
    num_decoded: int = 0  # token ids fed to detok
    num_sent_tokens: int = 0  # token ids already in an output (delta_token_ids start here)
    num_sent_chars: int = 0  # chars of text already in an output (delta_text starts here)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # finish_reason "error": why
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    flushed: bool = False
    hide_last: bool = False  # it stopped on a stop token / EOS whose text is left out
    logprobs: SampleLogprobsState | None = None  # None: the core sends none for this sequence
    beam: tuple[float, float] | None = None  # beam search: (cumulative logprob, score), sent by the core

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float:
        assert self.logprobs is not None, "only sequences with logprobs are ranked"
        return self.logprobs.cumulative


class RequestState:
    """One request's output state. `request_id` is the id its outputs carry; the processor's key
    is the id the core knows it by (AsyncLLM gives the core ids of its own). `stream` is False
    for a best_of > n request whatever the caller asked: it has no partial outputs."""

    def __init__(
        self, request_id: str, core_request_id: str, request: EngineCoreRequest, stream: bool, decoder: Decoder | None
    ):
        self.request_id = request_id
        self.core_request_id = core_request_id
        self.prompt = request.prompt
        self.prompt_token_ids = request.prompt_token_ids
        params = self.params = request.params
        self.ranked = params.num_samples > params.n  # best_of: return the n best of num_samples
        # False: one output, when finished (best_of and beam search have no partial outputs)
        self.stream = stream and not self.ranked and not params.use_beam_search
        self.arrival_time = request.arrival_time
        self.stops = params.stop_list
        self.longest_stop = max(map(len, self.stops), default=0)
        # the text make_output holds back while a stop string may still complete
        self.holdback = 0 if params.include_stop_str_in_output else max(0, self.longest_stop - 1)
        self.decoder = decoder  # this request's (None: no text)
        eager = decoder is not None and (self.stream or bool(self.stops))
        self.seqs = [SequenceState(i, self.new_detokenizer() if eager else None) for i in range(params.num_samples)]
        k = params.sample_logprobs
        if k is not None:
            for seq in self.seqs:
                seq.logprobs = SampleLogprobsState(shown=params.logprobs is not None)
        self.asks_logprobs = k is not None or params.prompt_logprobs is not None
        self.raw_prompt_logprobs: list[TokenLogprobs] | None = None  # from index 0's first output
        self.prompt_logprobs: PromptLogprobs | None = None  # built from it by the first make_output

    def new_detokenizer(self) -> IncrementalDetokenizer:
        assert self.decoder is not None
        return IncrementalDetokenizer(self.decoder, self.prompt_token_ids, self.params.skip_special_tokens)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    @property
    def has_new_tokens(self) -> bool:
        """Token ids have arrived that no output has carried yet."""
        return any(len(s.token_ids) > s.num_sent_tokens for s in self.seqs)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class ProcessedOutputs:
    touched: list[RequestState]  # requests that got tokens or finished, in order of first output
    stopped: list[tuple[str, int]]  # (core request id, sequence index) that hit a stop string
    finished: list[RequestState]  # requests whose last sequence finished (no longer tracked)


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        """tokenizer None: outputs carry token ids only (text ""), and stop strings are not matched."""
        self.decoder: Decoder | None = fast_decoder(tokenizer) if tokenizer is not None else None
        self.spaced: Decoder | None = None  # skip_special_tokens=False with spaces_between_special_tokens
        if self.decoder is not None:
            self.spaced = SpacedDecoder(self.decoder, special_ids_of(tokenizer))
        self.token_texts = TokenTexts(self.decoder)  # logprobs' decoded_token, one decode per id
        self.requests: dict[str, RequestState] = {}  # core request id -> unfinished request

    def add_request(self, request: EngineCoreRequest, stream: bool, core_request_id: str | None = None) -> RequestState:
        """Track a request the core now has. Its outputs carry `request.request_id`; the core's
        outputs for it carry `core_request_id` (default: the same)."""
        key = request.request_id if core_request_id is None else core_request_id
        assert key not in self.requests, "the core refuses a request id in use"
        state = RequestState(request.request_id, key, request, stream, self.decoder_for(request.params))
        self.requests[key] = state
        return state

    def decoder_for(self, params: SamplingParams) -> Decoder | None:
        if not params.detokenize:
            return None
        if not params.skip_special_tokens and params.spaces_between_special_tokens:
            return self.spaced
        return self.decoder

    def abort_request(self, core_request_id: str) -> RequestState | None:
        """Stop tracking; its unfinished sequences end with finish_reason "abort" (no flush)."""
        state = self.requests.pop(core_request_id, None)
        if state is not None:
            for seq in state.seqs:
                if not seq.finished:
                    seq.finish_reason = "abort"
        return state

    # ---- as tokens arrive --------------------------------------------------------------
    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        touched: dict[str, RequestState] = {}
        stopped: list[tuple[str, int]] = []
        finished: list[RequestState] = []
        get = self.requests.get
        for out in outputs:  # once per sequence per step: kept lean (the engine core's host time)
            state = get(out.request_id)
            if state is None:
                continue  # aborted or stopped while the core still ran it
            seq = state.seqs[out.index]
            if seq.finish_reason is not None:
                continue  # stopped by a stop string; the core has not heard yet
            touched[out.request_id] = state
            if state.asks_logprobs:
                self._take_logprobs(state, seq, out)
            if out.finish_reason is None and not state.stops:  # the common case: one more token
                seq.token_ids += out.new_token_ids
                seq.num_cached_tokens = out.num_cached_tokens
                if seq.first_token_time is None:
                    seq.first_token_time = out.first_token_time
                continue
            if self._append(state, seq, out):
                stopped.append((out.request_id, out.index))
            if seq.finished and state.finished:
                del self.requests[out.request_id]
                finished.append(state)
        return ProcessedOutputs(list(touched.values()), stopped, finished)

    @staticmethod
    def _take_logprobs(state: RequestState, seq: SequenceState, out: EngineCoreOutput) -> None:
        """Keep the raw entries (before the token ids are appended: a stop string cuts both)."""
        if out.prompt_logprobs is not None:
            state.raw_prompt_logprobs = out.prompt_logprobs
        if seq.logprobs is not None and out.new_token_ids:
            lps = out.new_logprobs
            assert lps is not None and len(lps) == len(out.new_token_ids), "the core sends one per token asked for"
            seq.logprobs.extend(lps)

    def _append(self, state: RequestState, seq: SequenceState, out: EngineCoreOutput) -> bool:
        """Apply one core output; True when a stop string ended the sequence."""
        seq.hide_last = out.stop_token and not state.params.include_stop_str_in_output and bool(out.new_token_ids)
        if out.new_token_ids:
            start = len(seq.token_ids)
            seq.token_ids.extend(out.new_token_ids)
            seq.num_cached_tokens = out.num_cached_tokens
            if seq.first_token_time is None:
                seq.first_token_time = out.first_token_time
            if state.stops and seq.detok is not None and self._match_stops(state, seq, start, out.finish_reason):
                return True
        if out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason, seq.finish_time = out.finish_reason, out.stop_reason, out.finish_time
            seq.error = out.error
        if out.score is not None:
            assert out.cumulative_logprob is not None
            seq.beam = (out.cumulative_logprob, out.score)
        return False

    @staticmethod
    def _match_stops(state: RequestState, seq: SequenceState, start: int, finish_reason: str | None) -> bool:
        """Detokenize the new tokens one by one and look for a stop string in the text each adds."""
        detok = seq.detok
        assert detok is not None
        last = len(seq.token_ids) - 1
        for i in range(start, len(seq.token_ids) - seq.hide_last):
            before = len(detok.text)
            detok.step([seq.token_ids[i]])
            seq.num_decoded = i + 1
            if (finish_reason is not None and i == last) or i + 1 < state.params.min_tokens:
                continue
            window = max(0, before - state.longest_stop + 1)
            hit = min(((pos, s) for s in state.stops if (pos := detok.text.find(s, window)) >= 0), default=None)
            if hit is not None:
                keep = hit[0] + len(hit[1]) if state.params.include_stop_str_in_output else hit[0]
                detok.text = detok.text[:keep]
                del seq.token_ids[i + 1 :]
                if seq.logprobs is not None:
                    seq.logprobs.truncate(i + 1)
                seq.finish_reason, seq.stop_reason, seq.finish_time = "stop", hit[1], time.monotonic()
                return True
        return False

    # ---- when asked ----------------------------------------------------------------------
    def make_output(self, state: RequestState) -> RequestOutput:
        """Everything new since the last output of this request (its first: everything). A best_of
        request (state.ranked) is asked only once it has finished: its n best sequences."""
        seqs = state.seqs
        if state.ranked:
            assert state.finished, "a best_of request has no partial outputs (RequestState.stream is False)"
            seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[: state.params.n]  # stable: ties by index
        texts = self.token_texts
        completions = []
        for position, seq in enumerate(seqs):
            ids = seq.token_ids
            delta_ids = ids[seq.num_sent_tokens :]
            seq.num_sent_tokens = len(ids)
            text = self._text(state, seq)
            end = len(text)
            if state.stops and not seq.finished:  # hold back what may be the start of a stop string
                end = max(seq.num_sent_chars, end - state.holdback)
            delta = text[seq.num_sent_chars : end]
            seq.num_sent_chars = end
            lp = seq.logprobs
            completions.append(
                CompletionOutput(
                    index=position if state.ranked else seq.index,
                    text=text,
                    token_ids=list(ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    error=seq.error,
                    cumulative_logprob=seq.beam[0] if seq.beam else (None if lp is None else lp.cumulative),
                    logprobs=None if lp is None else lp.output(texts),
                    score=seq.beam[1] if seq.beam else None,
                    delta_text=delta,
                    delta_token_ids=delta_ids,
                )
            )
        if state.prompt_logprobs is None and state.raw_prompt_logprobs is not None:
            state.prompt_logprobs = prompt_logprobs_of(state.raw_prompt_logprobs, texts)
        first = state.seqs[0]
        finish_time = None  # the request's: its last sequence's
        if state.finished:
            finish_time = max((s.finish_time for s in state.seqs if s.finish_time is not None), default=None)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=state.finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=RequestMetrics(state.arrival_time, first.first_token_time, finish_time),
            prompt_logprobs=state.prompt_logprobs,
        )

    def _text(self, state: RequestState, seq: SequenceState) -> str:
        """The sequence's text so far: feed the detokenizer what it has not seen (once)."""
        if state.decoder is None:
            return ""
        detok = seq.detok
        shown = len(seq.token_ids) - seq.hide_last  # the tokens whose text counts
        if detok is None:
            if not seq.finished:
                return ""  # not streamed: nothing to show before the end
            detok = seq.detok = state.new_detokenizer()
            detok.decode_all(seq.token_ids[:shown])  # decode once; decode_all's text needs no flush
            seq.num_decoded, seq.flushed = shown, True
        elif seq.num_decoded < shown:
            detok.step(seq.token_ids[seq.num_decoded : shown])
            seq.num_decoded = shown
        if seq.finished and not seq.flushed:
            seq.flushed = True
            if seq.finish_reason != "abort" and not isinstance(seq.stop_reason, str):
                detok.flush()  # EOS, stop token or length: nothing more will complete it
        return detok.text
