"""The structured-output fields of a request body -> one StructuredOutputsParams.

Both endpoints take the same forms (vLLM's): OpenAI's `response_format` (`{"type": "text"}` is
none; `{"type": "json_object"}`; `{"type": "json_schema", "json_schema": {"name", "schema",
"strict"}}`), vLLM's `structured_outputs` object (`json`, `regex`, `choice`, `grammar`,
`json_object`, `disable_any_whitespace`) and its older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`. A request uses at most one of these fields: two are a 400.

The name the client used is returned with the params: an error about the grammar raised later
(param `structured_outputs`, e.g. a schema the library cannot compile) names that field.
`strict` in a json_schema is accepted either way: the schema is always enforced.
"""

from __future__ import annotations

from typing import Any

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.sampling_params import StructuredOutputsParams
from pagedllm.entrypoints.openai.errors import bad_request

STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
BACKENDS = ("guidance", "auto")  # vLLM's name for llguidance, and "let the server pick"
_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if not isinstance(fmt, dict):
        raise bad_request("response_format must be an object with a 'type'", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                'response_format of type "json_schema" needs json_schema.schema, a JSON schema object',
                "response_format",
            )
        return {"json": schema}
    raise bad_request(
        f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r:.60}', "response_format"
    )


def _structured_outputs(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    unknown = sorted(set(obj) - set(_KEYS))
    if unknown:
        raise bad_request(f"structured_outputs has unknown keys {unknown}; known: {list(_KEYS)}", "structured_outputs")
    return {k: v for k, v in obj.items() if v is not None}


def _guided(name: str, value: Any) -> dict[str, Any]:
    return {name.removeprefix("guided_"): value}


def structured_outputs_of(body: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str]:
    """(the params or None, the field the client used). Shapes are checked here and by
    StructuredOutputsParams; whether the grammar compiles is checked further in."""
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise bad_request(
            f"guided_decoding_backend must be one of {list(BACKENDS)} (structured output uses llguidance), "
            f"got {backend!r:.60}",
            "guided_decoding_backend",
        )
    given: list[tuple[str, dict[str, Any]]] = []
    for name in STRUCTURED_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if name == "response_format":
            spec = _response_format(value)
        elif name == "structured_outputs":
            spec = _structured_outputs(value)
        else:
            spec = _guided(name, value)
        if spec is not None:
            given.append((name, spec))
    if not given:
        return None, "structured_outputs"
    if len(given) > 1:
        names = [n for n, _ in given]
        raise bad_request(f"a request may use one structured-output field; got {names}", names[1])
    name, spec = given[0]
    if not isinstance(spec.get("disable_any_whitespace", True), bool):
        raise bad_request("structured_outputs.disable_any_whitespace must be a boolean", name)
    try:
        return StructuredOutputsParams(**spec), name
    except InvalidRequestError as e:
        raise bad_request(e.message, name) from None
