"""StructuredOutputsParams -> an llguidance grammar, and the check made at the edge.

A request's constraint becomes one llguidance grammar text (`grammar_spec`):
- `json`: a JSON schema (a dict or its JSON text); `json_object`: the schema {"type": "object"};
  `disable_any_whitespace` (default True) compiles them with llguidance's JSON option
  `whitespace_flexible` False: no free whitespace between JSON tokens, only `,` and `:`.
- `regex`: the whole output matches it (llguidance's regex syntax, Rust's `regex` crate).
- `choice`: one of the strings exactly (a Lark rule of string literals).
- `grammar`: a Lark grammar in llguidance's dialect; a GBNF grammar (llama.cpp's) is converted to
  Lark first when it does not read as Lark (llguidance.gbnf_to_lark.any_to_lark).

A JSON schema is read strictly (`strict_schema`): an object schema listing `properties` and
saying nothing of `additionalProperties` allows no other key, as if it said
`"additionalProperties": false` (vLLM's xgrammar and OpenAI's strict mode read it so); an explicit
`true` or a schema there is kept. The key keeps the schema as sent; the rewrite is made when
compiling, so one schema still compiles to one grammar.

`disable_any_whitespace` means something to the JSON kinds only; the others write exactly what
their grammar says. The key of a grammar (`GrammarKey`) is what both caches (the check here and
the compiled matchers of structured_output.py) are keyed by: equal keys compile alike.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from llguidance import LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import any_to_lark

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.sampling_params import StructuredOutputsParams

PARAM = "structured_outputs"
CHECK_CACHE_SIZE = 256  # grammars whose check is remembered (a pure function of the key)


class GrammarKey(NamedTuple):
    kind: str  # "json" | "json_object" | "regex" | "choice" | "grammar"
    text: str  # the schema as canonical JSON text, the regex, the choices as JSON, the grammar
    compact: bool  # JSON kinds: disable_any_whitespace (False for the other kinds)


def grammar_key(so: StructuredOutputsParams) -> GrammarKey:
    if so.json is not None:
        if isinstance(so.json, str):
            try:
                schema = json.loads(so.json)
            except ValueError as e:
                raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {e}", PARAM) from None
        else:
            schema = so.json
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("structured_outputs.json must be a JSON schema object", PARAM)
        return GrammarKey("json", json.dumps(schema), so.disable_any_whitespace)  # key order: the output's
    if so.json_object:
        return GrammarKey("json_object", "", so.disable_any_whitespace)
    if so.regex is not None:
        return GrammarKey("regex", so.regex, False)
    if so.choice is not None:
        return GrammarKey("choice", json.dumps(so.choice), False)
    assert so.grammar is not None, "StructuredOutputsParams sets exactly one kind"
    return GrammarKey("grammar", so.grammar, False)


# JSON Schema keywords by where their subschemas apply (strict_schema)
CHILD = ("items", "additionalItems", "unevaluatedItems", "contains", "additionalProperties")  # a schema, or a list
CHILD_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # {name: schema}
ALTERNATIVES = ("anyOf", "oneOf")  # one of them holds with the parent
CONJUNCTS = ("allOf", "then", "else")  # they hold with the parent (a schema, or a list)
CONJUNCT_MAPS = ("dependentSchemas", "dependencies")  # {key: schema}, holds with the parent
ADDS_KEYS = ("properties", "patternProperties", "additionalProperties", "$ref", *ALTERNATIVES, *CONJUNCTS)


def strict_schema(schema: Any, closable: bool = True) -> Any:
    """A copy of a JSON schema in which every object schema that lists `properties` and has no
    `additionalProperties` (nor `unevaluatedProperties`) key gets `"additionalProperties": false`,
    in nested objects, items, $defs, anyOf and the rest alike; the caller's schema is not changed.

    JSON Schema's `additionalProperties` sees only the `properties` and `patternProperties` beside
    it, so `false` would also refuse keys that a schema met with the same object lists. Those stay
    open: a member of allOf / then / else / dependentSchemas (closable=False), an object whose own
    $ref or allOf / anyOf / oneOf / then / else member adds keys, and an anyOf / oneOf member whose
    parent lists keys itself. `not` and `if` are kept as written: closing them would change what
    they refuse or which branch applies."""
    if not isinstance(schema, dict):
        return schema  # a boolean schema, or not a schema at all (llguidance says what is wrong)
    out = dict(schema)

    def each(k: str, closable: bool = True) -> None:
        sub = schema.get(k)
        if isinstance(sub, list):
            out[k] = [strict_schema(s, closable) for s in sub]
        elif isinstance(sub, dict):
            out[k] = strict_schema(sub, closable)

    def each_value(k: str, closable: bool = True) -> None:
        if isinstance(schema.get(k), dict):
            out[k] = {name: strict_schema(sub, closable) for name, sub in schema[k].items()}

    for k in (*CHILD, "prefixItems"):
        each(k)
    for k in CHILD_MAPS:
        each_value(k)
    lists_keys = "properties" in schema or "patternProperties" in schema
    for k in ALTERNATIVES:
        each(k, closable=not lists_keys)
    for k in CONJUNCTS:
        each(k, closable=False)
    for k in CONJUNCT_MAPS:
        each_value(k, closable=False)
    members = [m for k in (*ALTERNATIVES, *CONJUNCTS) for m in _as_list(schema.get(k))]
    composed = "$ref" in schema or any(isinstance(m, dict) and any(a in m for a in ADDS_KEYS) for m in members)
    if (
        closable
        and isinstance(schema.get("properties"), dict)
        and "additionalProperties" not in schema
        and "unevaluatedProperties" not in schema
        and not composed
    ):
        out["additionalProperties"] = False
    return out


def _as_list(x: Any) -> list[Any]:
    return x if isinstance(x, list) else [] if x is None else [x]


def grammar_spec(key: GrammarKey) -> str:
    """The llguidance grammar text of a key. Raises ValueError when it cannot even be built
    (a schema llguidance's JSON front end refuses, a GBNF grammar that does not convert)."""
    if key.kind in ("json", "json_object"):
        schema = json.dumps(strict_schema(json.loads(key.text))) if key.kind == "json" else '{"type": "object"}'
        return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": not key.compact})
    if key.kind == "regex":
        return LLMatcher.grammar_from_regex(key.text)
    if key.kind == "choice":
        # each choice a JSON-quoted Lark string literal: the text exactly, escapes and all
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(key.text)))
    return LLMatcher.grammar_from_lark(any_to_lark(key.text))


@functools.lru_cache(maxsize=CHECK_CACHE_SIZE)
def _check(key: GrammarKey) -> str:
    """llguidance's error message for the key's grammar, "" when it compiles (memoised: a pure
    function of the key, so a grammar sent again is not parsed again)."""
    try:
        spec = grammar_spec(key)
    except (ValueError, RuntimeError) as e:
        return str(e)
    return LLMatcher.validate_grammar(spec)


class GrammarCompileError(RuntimeError):
    """Structured output cannot run on this server (its llguidance tokenizer could not be built
    from the model's tokenizer): not the request's fault. The server answers 500 with this message."""


def grammar_tokenizer(tokenizer: Any, vocab_size: int | None, eos_token_ids: Any) -> Callable[[], LLTokenizer]:
    """Structured output's tokenizer, built when first needed (~0.2-1 s): the HF tokenizer's
    vocabulary as wide as the model's logits (vocab_size; None: the tokenizer's own), every EOS id
    of the engine as an EOS of the grammar (llguidance >= 1.7 takes a list)."""

    built: list[LLTokenizer] = []  # once: the edge check and the core share it
    lock = threading.Lock()

    def build() -> LLTokenizer:
        from llguidance.hf import from_tokenizer

        with lock:
            if not built:
                eos = sorted(eos_token_ids) or None
                built.append(from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos))
            return built[0]

    return build


class GrammarChecker:
    """The edge check (InputProcessor): a request's grammar parsed on its own (llguidance's
    validator, memoised in `_check`), then compiled over the model's own tokenizer, as the engine
    will compile it, so that a grammar the engine would fail on is a 400 before the request is
    queued. The verdicts over the tokenizer (llguidance's error, "" when it compiles) are memoised
    per GrammarKey, CHECK_CACHE_SIZE of them."""

    def __init__(self, tokenizer_factory: Callable[[], LLTokenizer] | None):
        """tokenizer_factory: called for each compilation, so it should build once (grammar_tokenizer
        does); None: no tokenizer (token-id prompts), the syntax check only."""
        self._factory = tokenizer_factory
        self._lock = threading.Lock()  # the server prepares requests on several worker threads
        self._verdicts: OrderedDict[GrammarKey, str] = OrderedDict()

    def check(self, so: StructuredOutputsParams | None) -> None:
        """Raise InvalidRequestError(param="structured_outputs") with llguidance's message when the
        schema, regex, choices or grammar cannot be compiled; GrammarCompileError when llguidance
        cannot build its tokenizer; None passes."""
        if so is None:
            return
        key = grammar_key(so)
        error = _check(key)
        if error:
            raise InvalidRequestError(f"structured_outputs.{key.kind} cannot be compiled: {error}", PARAM)
        if self._factory is None:
            return
        with self._lock:
            verdict = self._verdicts.get(key)
            if verdict is not None:
                self._verdicts.move_to_end(key)
        if verdict is None:  # compiled outside the lock: two threads may both compile one grammar
            matcher = LLMatcher(self._llg_tokenizer(), grammar_spec(key), log_level=0)
            verdict = matcher.get_error() if matcher.is_error() else ""
            with self._lock:
                self._verdicts[key] = verdict
                while len(self._verdicts) > CHECK_CACHE_SIZE:
                    self._verdicts.popitem(last=False)
        if verdict:
            raise InvalidRequestError(
                f"structured_outputs.{key.kind} cannot be compiled over the model's tokenizer: {verdict}", PARAM
            )

    def _llg_tokenizer(self) -> LLTokenizer:
        assert self._factory is not None
        try:
            return self._factory()
        except Exception as e:  # an llguidance that cannot read this tokenizer: the server's problem
            raise GrammarCompileError(
                f"structured output is unavailable: llguidance could not build its tokenizer from the "
                f"model's tokenizer ({type(e).__name__}: {e})"
            ) from e
