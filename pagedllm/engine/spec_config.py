"""speculative_config: what LLM(speculative_config=...) and --speculative-config (JSON) take, with
vLLM's keys, checked once at the edge; every refusal names its field (`speculative_config.<key>`).
Speculative decoding itself: spec_decode.py (proposing) and spec_verify.py (verifying); a draft
model's proposals: spec_draft.py (engine side), worker/draft_model.py (its forwards). That the draft
directory exists, runs and shares the target's vocabulary is checked where models are loaded
(entrypoints/draft_check.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.errors import InvalidRequestError

FIELD = "speculative_config"
METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32
DEFAULT_PROMPT_LOOKUP_MAX = 5
DEFAULT_PROMPT_LOOKUP_MIN = 2
# the largest batch that proposes by default: measured on one H200 (docs/features/speculative-decoding.md)
DEFAULT_DISABLE_BY_BATCH_SIZE = 16
_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "model",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's keys. `num_speculative_tokens` k: proposals per step and sequence at most;
    `prompt_lookup_max` / `prompt_lookup_min`: the longest and shortest n-gram looked up (method
    "ngram"); `model`: the draft model's directory (method "draft_model", implied by `model`);
    `disable_by_batch_size`: a step proposes only while at most this many sequences run (a
    verification step costs more than a decode step, and at large batches more than its accepted
    tokens save); None: at any batch size. Absent from the dict: DEFAULT_DISABLE_BY_BATCH_SIZE."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    def proposes_at(self, num_running: int) -> bool:
        """Whether a step with `num_running` running sequences may propose."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size

    @classmethod
    def parse(cls, value: Mapping[str, Any] | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From LLM's argument or --speculative-config's JSON; InvalidRequestError naming the field."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{FIELD} must be a JSON object: {e}", FIELD) from None
        if not isinstance(value, Mapping):
            raise InvalidRequestError(f"{FIELD} must be a dict (a JSON object), got {type(value).__name__}", FIELD)
        for key in value:
            if key not in _KEYS:
                raise InvalidRequestError(
                    f"{FIELD}.{key} is not supported; the keys are {', '.join(_KEYS)}", f"{FIELD}.{key}"
                )
        model = value.get("model")
        method = value.get("method", "draft_model" if model is not None else "ngram")
        if method not in METHODS:
            raise InvalidRequestError(
                f"{FIELD}.method must be one of {', '.join(METHODS)}, got {method!r}", f"{FIELD}.method"
            )
        if "num_speculative_tokens" not in value:
            raise InvalidRequestError(f"{FIELD}.num_speculative_tokens is required", f"{FIELD}.num_speculative_tokens")
        k = _int(value, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        limit: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE  # absent; null: any batch size
        if "disable_by_batch_size" in value:
            limit = None if value["disable_by_batch_size"] is None else _int(value, "disable_by_batch_size", 1, 1 << 20)
        if method == "draft_model":
            return cls(k, method, disable_by_batch_size=limit, model=_draft_dir(value))
        if model is not None:
            raise InvalidRequestError(
                f"{FIELD}.model names a draft model: it needs method 'draft_model' (or no method), got {method!r}",
                f"{FIELD}.model",
            )
        hi = _int(value, "prompt_lookup_max", 1, 1 << 16) if value.get("prompt_lookup_max") is not None else None
        lo = _int(value, "prompt_lookup_min", 1, 1 << 16) if value.get("prompt_lookup_min") is not None else None
        if hi is None and lo is None:
            hi, lo = DEFAULT_PROMPT_LOOKUP_MAX, DEFAULT_PROMPT_LOOKUP_MIN
        hi, lo = hi or lo, lo or hi  # one given: the other is the same (vLLM's rule)
        assert hi is not None and lo is not None
        if lo > hi:
            raise InvalidRequestError(
                f"{FIELD}.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})", f"{FIELD}.prompt_lookup_min"
            )
        return cls(k, method, hi, lo, limit)


def _draft_dir(value: Mapping[str, Any]) -> str:
    """The draft model's directory (a string; whether it holds a model: entrypoints/draft_check.py);
    the n-gram keys do not apply to it."""
    for key in ("prompt_lookup_max", "prompt_lookup_min"):
        if value.get(key) is not None:
            raise InvalidRequestError(
                f"{FIELD}.{key} applies to method 'ngram', not to a draft model", f"{FIELD}.{key}"
            )
    model = value.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError(
            f"{FIELD}.model must be the draft model's directory (a non-empty string), got {model!r}", f"{FIELD}.model"
        )
    return model


def _int(value: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    v = value[key]
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise InvalidRequestError(f"{FIELD}.{key} must be an integer in [{lo}, {hi}], got {v!r}", f"{FIELD}.{key}")
    return v
