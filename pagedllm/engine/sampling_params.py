"""SamplingParams: vLLM's names and defaults, validated on construction.

Every rule a sampling field must obey is written here once; a violation raises
InvalidRequestError naming the field (`param`), whichever door the request came through.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.errors import InvalidRequestError

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a seed is a signed 64-bit integer (the device's generator key)
GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS): 1/T would overflow
TOKEN_ID_MAX = 2**31 - 1  # bound of token ids and top_k: no vocabulary is larger, every device integer holds it
MAX_LOGPROBS = 20  # the most top-k logprobs a request may ask for, per token (vLLM's default max_logprobs)
MAX_BEAM_WIDTH = 64  # the widest beam search a request may ask for (also bounded by max_num_seqs)
EARLY_STOPPING = (True, False, "never")  # HF's generation_config.early_stopping values
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
LOGIT_BIAS_MAX = 100.0  # a logit_bias value is clamped to [-100, 100] (OpenAI's range)


@dataclass
class StructuredOutputsParams:
    """What a sequence's output must match (vLLM's StructuredOutputsParams): exactly one of
    `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice` (one of these strings),
    `grammar` (a Lark / EBNF grammar, llguidance's dialect) or `json_object` (any JSON object).

    `disable_any_whitespace` (default True here, vLLM's default is False): JSON is written without
    free whitespace between its tokens; a small model given free whitespace tends to write
    whitespace until it runs out of tokens. The grammar is compiled and checked by
    `engine/structured_output.py` (a 400 naming the field when it cannot be compiled)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = [
            k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) not in (None, False)
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                f"got {given or 'none'}",
                param="structured_outputs",
            )
        if self.choice is not None and not (
            isinstance(self.choice, list) and self.choice and all(isinstance(c, str) for c in self.choice)
        ):
            raise InvalidRequestError(
                "structured_outputs.choice must be a non-empty list of strings", "structured_outputs"
            )
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and v):
                raise InvalidRequestError(f"structured_outputs.{name} must be a non-empty string", "structured_outputs")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequestError(
                "structured_outputs.json must be a JSON schema (an object or its JSON text)", "structured_outputs"
            )


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


def all_ints(xs: Any) -> bool:
    """Every item is an int and none is a bool (JSON's true is not a token id). One pass in C for
    the usual list of plain ints (a 512-token prompt: ~12 us against ~45 for the generator); any
    other item type falls back to the item-by-item rule, so int subclasses other than bool pass."""
    kinds = set(map(type, xs))
    if kinds <= {int}:
        return True
    return bool not in kinds and all(isinstance(t, int) for t in xs)


def first_outside(ids: Sequence[int], limit: int) -> int | None:
    """The first id not in [0, limit), else None: min and max in C, the scan only when one is out."""
    if not ids or (min(ids) >= 0 and max(ids) < limit):
        return None
    return next(t for t in ids if not 0 <= t < limit)


def _token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= TOKEN_ID_MAX


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
    # penalties (vLLM's semantics): presence/frequency count the output tokens only, repetition the
    # prompt's and the output's (a logit > 0 is divided by it, one < 0 multiplied)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
    allowed_token_ids: list[int] | None = None  # only these ids may be drawn
    bad_words: list[str] | None = None  # never generated; InputProcessor tokenizes them into bad_words_token_ids
    bad_words_token_ids: list[list[int]] | None = None  # each word's token ids (set by InputProcessor)
    include_stop_str_in_output: bool = False  # a matched stop string (or a stop token's text) stays in the text
    skip_special_tokens: bool = True  # special tokens' text is left out of the output text
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: max_model_len)
    detokenize: bool = True  # False: token ids only, text stays ""
    structured_outputs: StructuredOutputsParams | None = None
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
        self._check_controls(need)
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
                isinstance(self.stop_token_ids, (list, tuple)) and all_ints(self.stop_token_ids),
                "stop_token_ids",
                "must be a list of integers",
            )
            self.stop_token_ids = list(self.stop_token_ids)
            need(all(0 <= t <= TOKEN_ID_MAX for t in self.stop_token_ids), "stop_token_ids", "must be token ids >= 0")

    def _check_controls(self, need: Any) -> None:
        """Penalties, token controls and output switches: types and ranges. Token ids are checked
        against the vocabulary by the InputProcessor (it knows the model)."""
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            need(
                isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v), name, "must be a finite number"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            need(
                -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY, name, f"must be in [-{MAX_PENALTY}, {MAX_PENALTY}]"
            )
        need(self.repetition_penalty > 0, "repetition_penalty", "must be > 0 (1 is off)")
        if self.logit_bias is not None:
            need(isinstance(self.logit_bias, Mapping), "logit_bias", "must map token ids to numbers")
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                tid = int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k  # JSON keys are strings
                need(
                    isinstance(tid, int) and not isinstance(tid, bool) and 0 <= tid <= TOKEN_ID_MAX,
                    "logit_bias",
                    "keys must be token ids >= 0",
                )
                need(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v),
                    "logit_bias",
                    "values must be finite numbers",
                )
                bias[tid] = max(-LOGIT_BIAS_MAX, min(LOGIT_BIAS_MAX, float(v)))
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            need(
                isinstance(ids, (list, tuple)) and ids and all(_token_id(t) for t in ids),
                "allowed_token_ids",
                "must be a non-empty list of token ids >= 0",
            )
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            need(
                isinstance(self.bad_words, (list, tuple))
                and all(isinstance(w, str) and w and not has_surrogate(w) for w in self.bad_words),
                "bad_words",
                "must be a list of non-empty strings",
            )
            self.bad_words = list(self.bad_words)
        if self.bad_words_token_ids is not None:
            need(
                isinstance(self.bad_words_token_ids, (list, tuple))
                and all(
                    isinstance(w, (list, tuple)) and w and all(_token_id(t) for t in w)
                    for w in self.bad_words_token_ids
                ),
                "bad_words",
                "token ids must be non-empty lists of token ids >= 0",
            )
            self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids]
        for name in (
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "detokenize",
        ):
            need(isinstance(getattr(self, name), bool), name, "must be a boolean")
        t = self.truncate_prompt_tokens
        need(
            t is None or (isinstance(t, int) and not isinstance(t, bool) and (t >= 1 or t == -1)),
            "truncate_prompt_tokens",
            "must be an integer >= 1, -1 (the model's context) or None",
        )
        need(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams",
        )
        if not self.detokenize:  # stop strings are matched on text
            need(not self.stop_list and not self.stop, "stop", "needs detokenize=True (stop strings match text)")

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
        for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            need(getattr(self, name) == off, name, f"must be {off} with use_beam_search")
        for name in ("logit_bias", "allowed_token_ids", "bad_words", "structured_outputs"):
            need(getattr(self, name) is None, name, "is not supported with use_beam_search")

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
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_output_history(self) -> bool:
        """True when the next token's logits depend on the ids of the tokens before it (penalties,
        a bad word of several tokens, a grammar): under async scheduling such a sequence waits for
        its in-flight token before it is scheduled again."""
        multi_bad = any(len(w) > 1 for w in self.bad_words_token_ids or ())
        return self.uses_penalties or multi_bad or self.structured_outputs is not None

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
