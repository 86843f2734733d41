"""SamplingParams: vLLM's names and defaults, validated on construction.

Every rule a sampling field must obey is written here once; a violation raises
InvalidRequestError naming the field (`param`), whichever door the request came through.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.errors import InvalidRequestError

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a seed is a signed 64-bit integer (the device's generator key)
GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS): 1/T would overflow
TOKEN_ID_MAX = 2**31 - 1  # bound of token ids and top_k: no vocabulary is larger, every device integer holds it
MAX_LOGPROBS = 20  # the most top-k logprobs a request may ask for, per token (vLLM's default max_logprobs)
MAX_BEAM_WIDTH = 64  # the widest beam search a request may ask for (also bounded by max_num_seqs)
EARLY_STOPPING = (True, False, "never")  # HF's generation_config.early_stopping values


def has_surrogate(text: str) -> bool:
    """True when `text` holds a lone UTF-16 surrogate (JSON "\\ud800" decodes to one): it cannot
    be encoded as UTF-8, so no tokenizer, hash or response can take it. (Encoding scans faster
    than a regex search; isascii() is O(1).)"""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _finite(x: float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # 0 or -1 means off
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    best_of: int | None = None  # sample this many (>= n) and return the n with the highest cumulative logprob
    logprobs: int | None = None  # per output token: its logprob, rank and the top `logprobs` others
    prompt_logprobs: int | None = None  # per prompt token after the first: the same, teacher-forced
    cache_salt: str | None = None  # mixed into the first KV block's hash: only requests with equal salts share KV
    # beam search (vLLM's v0 names; the engine runs HF's algorithm, engine/beam_search.py): n beams,
    # greedy only, score = cumulative logprob / generated_len ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise InvalidRequestError(f"{name} {what}, got {getattr(self, name)!r}", param=name)

        for name in ("temperature", "top_p", "min_p"):
            need(
                isinstance(getattr(self, name), (int, float)) and not isinstance(getattr(self, name), bool),
                name,
                "must be a number",
            )
        for name in ("top_k", "max_tokens", "min_tokens", "n"):
            need(
                isinstance(getattr(self, name), int) and not isinstance(getattr(self, name), bool),
                name,
                "must be an integer",
            )
        need(_finite(self.temperature) and self.temperature >= 0, "temperature", "must be a finite number >= 0")
        if self.temperature < GREEDY_EPS:
            self.temperature = 0.0  # greedy; a denormal temperature would give inf / nan scores
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(
            self.top_k == -1 or 0 <= self.top_k <= TOKEN_ID_MAX,
            "top_k",
            "must be -1, 0 (off) or a positive integer up to 2**31 - 1 (at or above the vocabulary size it is off)",
        )
        need(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        need(0 <= self.min_tokens, "min_tokens", "must be >= 0")
        need(self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        need(self.n >= 1, "n", "must be >= 1")
        need(
            self.best_of is None or (isinstance(self.best_of, int) and not isinstance(self.best_of, bool)),
            "best_of",
            "must be an integer or None",
        )
        need(self.best_of is None or self.best_of >= self.n, "best_of", f"must be >= n (n={self.n})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            need(v is None or (isinstance(v, int) and not isinstance(v, bool)), name, "must be an integer or None")
            need(v is None or 0 <= v <= MAX_LOGPROBS, name, f"must be in [0, {MAX_LOGPROBS}]")
        need(
            self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
            "seed",
            "must be an integer or None",
        )
        need(self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, "seed", "must fit in a signed 64-bit integer")
        if self.seed is not None and self.num_samples > 1:  # the i-th sample of the request draws with seed + i
            need(
                self.seed + self.num_samples - 1 <= SEED_MAX,
                "seed",
                f"+ {'best_of' if self.best_of else 'n'} - 1 must fit in a signed 64-bit integer (n={self.num_samples})",
            )
        need(
            self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""),
            "cache_salt",
            "must be a non-empty string or None",
        )
        need(
            self.cache_salt is None or not has_surrogate(self.cache_salt),
            "cache_salt",
            "must be text (no lone UTF-16 surrogates)",
        )
        need(isinstance(self.use_beam_search, bool), "use_beam_search", "must be a boolean")
        need(
            isinstance(self.length_penalty, (int, float))
            and not isinstance(self.length_penalty, bool)
            and _finite(self.length_penalty),
            "length_penalty",
            "must be a finite number",
        )
        need(
            self.early_stopping in EARLY_STOPPING and isinstance(self.early_stopping, (bool, str)),
            "early_stopping",
            "must be true, false or 'never'",
        )
        if self.use_beam_search:
            self._check_beam_search(need)
        else:  # they mean something only to beam search: accepted and ignored would be a wrong answer
            need(self.length_penalty == 1.0, "length_penalty", "needs use_beam_search (default 1.0 otherwise)")
            need(self.early_stopping is False, "early_stopping", "needs use_beam_search (default False otherwise)")
        if self.stop is None:
            self.stop_list = []
        elif isinstance(self.stop, str):
            self.stop_list = [self.stop]
        else:
            need(
                isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop),
                "stop",
                "must be a string or a list of strings",
            )
            self.stop_list = list(self.stop)
        need(all(self.stop_list), "stop", "must not contain empty strings")
        need(not any(has_surrogate(s) for s in self.stop_list), "stop", "must be text (no lone UTF-16 surrogates)")
        if self.stop_token_ids is not None:
            need(
                isinstance(self.stop_token_ids, (list, tuple))
                and all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids),
                "stop_token_ids",
                "must be a list of integers",
            )
            self.stop_token_ids = list(self.stop_token_ids)
            need(all(0 <= t <= TOKEN_ID_MAX for t in self.stop_token_ids), "stop_token_ids", "must be token ids >= 0")

    def _check_beam_search(self, need: Any) -> None:
        """What beam search (HF's, exact) supports: n beams, greedy, no logprobs or other samplers."""
        need(self.n <= MAX_BEAM_WIDTH, "n", f"(the beam width) must be <= {MAX_BEAM_WIDTH} with use_beam_search")
        need(self.temperature == 0, "temperature", "must be 0 with use_beam_search (beam search is greedy)")
        need(self.best_of is None or self.best_of == self.n, "best_of", "must be unset or equal n with use_beam_search")
        for name, off in (("top_p", 1.0), ("min_p", 0.0), ("min_tokens", 0)):
            need(getattr(self, name) == off, name, f"must be {off} with use_beam_search")
        need(self.top_k in (-1, 0), "top_k", "must be -1 or 0 with use_beam_search")
        need(self.logprobs is None, "logprobs", "is not supported with use_beam_search")
        need(self.prompt_logprobs is None, "prompt_logprobs", "is not supported with use_beam_search")
        need(self.stop is None or self.stop == [], "stop", "is not supported with use_beam_search")
        need(not self.stop_token_ids, "stop_token_ids", "is not supported with use_beam_search")
        need(self.seed is None, "seed", "has no effect with use_beam_search (it is deterministic): leave it unset")

    @property
    def num_samples(self) -> int:
        """Sequences the request samples: best_of when set, else n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def sample_logprobs(self) -> int | None:
        """The top-k the sampler computes per output token: `logprobs`, or 0 (the sampled token's
        logprob only) when best_of needs cumulative logprobs to rank the samples; None: nothing."""
        if self.logprobs is not None:
            return self.logprobs
        return 0 if self.num_samples > self.n else None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class BeamSearchParams:
    """`LLM.beam_search`'s parameters, vLLM's names. Beam search is greedy and exact against HF
    transformers' `generate(num_beams=beam_width, do_sample=False, length_penalty=...,
    early_stopping=...)`; it runs as SamplingParams(use_beam_search=True, n=beam_width)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        try:
            self.sampling = SamplingParams(
                n=self.beam_width,
                max_tokens=self.max_tokens,
                ignore_eos=self.ignore_eos,
                temperature=self.temperature,
                use_beam_search=True,
                length_penalty=self.length_penalty,
                early_stopping=self.early_stopping,
            )
        except InvalidRequestError as e:
            if e.param != "n":
                raise
            raise InvalidRequestError(str(e).replace("n ", "beam_width ", 1), "beam_width", e.code) from None


def sampling_params_with_defaults(defaults: Mapping[str, Any], **given: Any) -> SamplingParams:
    """The one way a door builds a request's SamplingParams: the fields the caller gave (None =
    not given) win, the model's defaults (`generation_defaults`: its generation_config.json) fill
    the fields it left unset, and SamplingParams' own defaults the rest."""
    return SamplingParams(**{**defaults, **{k: v for k, v in given.items() if v is not None}})
