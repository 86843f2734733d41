"""Beam search, HF transformers' algorithm (`GenerationMixin._beam_search`), on the host.

The engine runs the beams of a request as Sequences that share blocks (the scheduler forks and
frees them, scheduler.py); this module only decides. Per step, with W beams and each live
beam's top K = max(2, 1 + #EOS ids) * W next tokens (log-softmax of the raw logits):
- candidates: every beam's cumulative logprob + each of its K logprobs; the best K overall
  (in order; the union of the beams' top K holds the global top K);
- a candidate "stops" when its token is EOS (unless ignore_eos) or it reaches max_tokens; a
  stopping candidate among the first W becomes a finished hypothesis with score
  cumulative / generated_len ** length_penalty (generated_len counts the EOS), unless the
  finished set is full under early_stopping=True or no improvement is possible; the finished
  set keeps the W best scores;
- the next beams are the first W candidates that do not stop (a beam chosen twice is forked);
- the search ends when no running beam can still improve on the worst finished score (HF's
  heuristic: the best running score over the current length, or over max_tokens with
  early_stopping="never" and length_penalty > 0), when early_stopping=True and W hypotheses are
  finished, or when every candidate stops (max_tokens).
Sums are float32, as HF's tensors, so that near ties order the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.step_result import TokenLogprobs

S = TypeVar("S")  # the engine's Sequence (engine/sequence.py), which holds its search: no import back

NEG = np.float32(-1.0e9)  # HF's "impossible" score
f32 = np.float32


@dataclass
class Hypothesis:
    """A finished beam: its output tokens (the stopping token included)."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop": it ended with EOS; "length": max_tokens


@dataclass
class Survivor:
    """A beam of the next step: the current beam `parent` (its rank) extended by `token`."""

    parent: int
    token: int
    cumulative_logprob: np.float32


class BeamSearch(Generic[S]):
    """The state of one request's search. `beams[i]` is running beam i (rank order), a Sequence
    the scheduler keeps (the list object is the request's entry in EngineCore.requests, updated
    in place), `scores[i]` its cumulative logprob."""

    def __init__(self, request_id: str, params: SamplingParams, eos_token_ids: frozenset[int]):
        assert params.use_beam_search
        self.request_id = request_id
        self.width = params.n
        self.eos = frozenset() if params.ignore_eos else eos_token_ids
        self.num_candidates = max(2, 1 + len(self.eos)) * self.width  # HF's beams_to_keep
        self.length_penalty = float(params.length_penalty)
        self.early_stopping = params.early_stopping
        self.max_tokens = params.max_tokens
        self.beams: list[S] = []
        self.scores: list[np.float32] = [f32(0.0)]  # one running beam: the prompt
        self.finished: list[Hypothesis] = []  # at most width, best first
        self.num_generated = 0
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied (once False, for good)
        self.done = False

    def _penalised(self, cumulative: np.float32, length: int) -> np.float32:
        out: np.float32 = cumulative / np.float32(float(length) ** self.length_penalty)
        return out

    def step(self, outputs: list[list[int]], topk: list[TokenLogprobs]) -> list[Survivor]:
        """One step: `topk[i]` is running beam i's result (its `token_ids[1:]` / `logprobs[1:]`
        the top K), `outputs[i]` its output tokens so far. Returns the next step's beams
        (empty when the search is done)."""
        assert not self.done and len(topk) == len(self.scores) == len(outputs)
        cands: list[tuple[np.float32, int, int]] = []  # (cumulative, beam, token)
        for beam, (score, entry) in enumerate(zip(self.scores, topk, strict=True)):
            k = min(self.num_candidates, len(entry.token_ids) - 1)
            for tid, lp in zip(entry.token_ids[1 : 1 + k], entry.logprobs[1 : 1 + k], strict=True):
                cands.append((f32(score + f32(lp)), beam, tid))
        cands.sort(key=lambda c: -c[0])  # stable: a tie keeps beam order, then the beam's top-k order
        cands = cands[: self.num_candidates]
        length = self.num_generated + 1
        at_max = length >= self.max_tokens
        stops = [at_max or tid in self.eos for _, _, tid in cands]
        self._finish(cands, stops, outputs, length)
        survivors = [Survivor(b, tid, cum) for (cum, b, tid), stop in zip(cands, stops, strict=True) if not stop]
        survivors = survivors[: self.width]
        self.num_generated = length
        best_running = survivors[0].cumulative_logprob if survivors else NEG
        self._check_improvable(best_running)
        full = len(self.finished) == self.width
        if not self.improvable or (full and self.early_stopping is True) or all(stops):
            self.done = True
            return []
        self.scores = [s.cumulative_logprob for s in survivors]
        return survivors

    def _finish(
        self, cands: list[tuple[np.float32, int, int]], stops: list[bool], outputs: list[list[int]], length: int
    ) -> None:
        """Stopping candidates among the first `width` join the finished hypotheses (HF's
        _update_finished_beams): not when the set is full under early_stopping=True, nor once no
        improvement is possible; the set keeps the `width` best scores."""
        if (len(self.finished) == self.width and self.early_stopping is True) or not self.improvable:
            return
        new = [
            Hypothesis(
                [*outputs[b], tid],
                float(cum),
                float(self._penalised(cum, length)),
                "length" if tid not in self.eos else "stop",
            )
            for (cum, b, tid), stop in zip(cands[: self.width], stops[: self.width], strict=True)
            if stop
        ]
        if new:
            merged = self.finished + new  # stable sort: on a tie the earlier-finished one stays first
            merged.sort(key=lambda h: -h.score)
            self.finished = merged[: self.width]

    def _check_improvable(self, best_running: np.float32) -> None:
        """HF's _check_early_stop_heuristic, after the step."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_tokens
        else:
            length = self.num_generated
        best_possible = self._penalised(best_running, length)
        if len(self.finished) < self.width:
            return  # an empty slot scores -1e9: anything improves on it
        worst = min(f32(h.score) for h in self.finished)
        self.improvable = self.improvable and bool(best_possible > worst)

    def results(self) -> list[Hypothesis]:
        """The finished hypotheses, best first (width of them once the search is done)."""
        return list(self.finished)
