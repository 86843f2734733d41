"""StructuredOutputsParams -> an llguidance grammar, and the check made at the edge.

A request's constraint becomes one llguidance grammar text (`grammar_spec`):
- `json`: a JSON schema (a dict or its JSON text); `json_object`: the schema {"type": "object"};
  `disable_any_whitespace` (default True) compiles them with llguidance's JSON option
  `whitespace_flexible` False: no free whitespace between JSON tokens, only `,` and `:`.
- `regex`: the whole output matches it (llguidance's regex syntax, Rust's `regex` crate).
- `choice`: one of the strings exactly (a Lark rule of string literals).
- `grammar`: a Lark grammar in llguidance's dialect; a GBNF grammar (llama.cpp's) is converted to
  Lark first when it does not read as Lark (llguidance.gbnf_to_lark.any_to_lark).

`disable_any_whitespace` means something to the JSON kinds only; the others write exactly what
their grammar says. The key of a grammar (`GrammarKey`) is what both caches (the check here and
the compiled matchers of structured_output.py) are keyed by: equal keys compile alike.
"""

from __future__ import annotations

import functools
import json
from typing import NamedTuple

from llguidance import LLMatcher
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


def grammar_spec(key: GrammarKey) -> str:
    """The llguidance grammar text of a key. Raises ValueError when it cannot even be built
    (a schema llguidance's JSON front end refuses, a GBNF grammar that does not convert)."""
    if key.kind in ("json", "json_object"):
        schema = key.text if key.kind == "json" else '{"type": "object"}'
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


def check_structured_outputs(so: StructuredOutputsParams | None) -> None:
    """Raise InvalidRequestError(param="structured_outputs") with llguidance's message when the
    schema, regex, choices or grammar cannot be compiled; None passes."""
    if so is None:
        return
    key = grammar_key(so)
    error = _check(key)
    if error:
        raise InvalidRequestError(f"structured_outputs.{key.kind} cannot be compiled: {error}", PARAM)
