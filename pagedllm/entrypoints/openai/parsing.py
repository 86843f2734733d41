"""Request parsing: a JSON body -> a `ParsedRequest` (prompts, the sampling fields the client
set, stream flags), every client mistake a 400 naming the field.

Bodies are read by hand rather than by pydantic models so that each mistake (malformed JSON, a
wrong JSON type, an option pagedllm does not implement) gets OpenAI's error schema and the
field's name. This module checks JSON shapes only; the values' rules (ranges, token ids,
lengths) are SamplingParams' and the InputProcessor's, applied once by `serving.py`.

Two rules hold for the whole body, checked once in `json_body` so that no field (including
`model` and a message's `role`, which never reach the engine, and fields added later) can
escape them: arrays and objects nest at most MAX_JSON_DEPTH deep (deeper bodies would make
every later recursive walk, from the chat template to an error report, a RecursionError), and
every string is text: a lone UTF-16 surrogate (JSON `"\ud800"`) cannot be encoded as UTF-8,
so no tokenizer, hash or response could take it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.sampling_params import MAX_LOGPROBS, all_ints, has_surrogate
from pagedllm.entrypoints.openai.errors import APIError, bad_request
from pagedllm.entrypoints.openai.structured_request import structured_outputs_of

MAX_JSON_DEPTH = 64  # the body object is depth 1: {"prompt": [[1]]} is 3 deep
MAX_REQUEST_ID = 256  # characters of a client's request_id

# body field -> JSON kind, for the fields that map one to one onto SamplingParams
SAMPLING_FIELDS = (
    ("temperature", "number"),
    ("top_p", "number"),
    ("top_k", "int"),
    ("min_p", "number"),
    ("min_tokens", "int"),
    ("ignore_eos", "bool"),
    ("seed", "int"),
    ("stop_token_ids", "list"),
    ("cache_salt", "str"),
    ("presence_penalty", "number"),
    ("frequency_penalty", "number"),
    ("repetition_penalty", "number"),
    ("logit_bias", "dict"),  # keys are strings in JSON: SamplingParams reads them as token ids
    ("allowed_token_ids", "list"),
    ("bad_words", "list"),
    ("include_stop_str_in_output", "bool"),
    ("skip_special_tokens", "bool"),
    ("spaces_between_special_tokens", "bool"),
    ("truncate_prompt_tokens", "int"),
    ("prompt_logprobs", "int"),
)
_KIND_NAMES = {
    "bool": "a boolean",
    "int": "an integer",
    "number": "a number",
    "str": "a string",
    "list": "an array",
    "dict": "an object",
}


@dataclass
class ShownLogprobs:
    """What an answer shows besides the text: `top` None = no logprobs, else the top-k per token
    (completions' `logprobs`, chat's `top_logprobs`); `echo`: the prompt precedes each choice."""

    top: int | None = None
    echo: bool = False
    prompt: bool = False  # the client asked for prompt_logprobs: the answer carries them
    as_token_ids: bool = False  # return_tokens_as_token_ids: tokens written "token_id:N"


@dataclass
class ParsedRequest:
    """One body, shape-checked. `fields` holds only what the client set (the model's defaults
    fill the rest); `prompt_param` and `max_tokens_param` are the fields' names as this
    endpoint's client spells them, for errors raised further in; `structured_param` likewise
    names the structured-output field the client used (`response_format`, `guided_json`...)."""

    prompts: list[Any]
    fields: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    prompt_param: str = "prompt"
    max_tokens_param: str = "max_tokens"
    n: int = 1  # choices per prompt
    shown: ShownLogprobs = field(default_factory=ShownLogprobs)
    model: str = ""  # the served name the answer carries (check_model)
    structured_param: str = "structured_outputs"
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    add_special_tokens: bool = True  # the tokenizer's special tokens around the prompt (chat: False)
    request_id: str | None = None  # the client's id: the answer's is "<prefix>-<request_id>"


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a valid JSON number")


_TOO_DEEP = f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} deep"
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")  # where a JSON text can spell a surrogate


def json_body(raw: bytes) -> dict[str, Any]:
    """The body as a dict whose nesting and strings obey the module's two rules."""
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # as json.loads(bytes) reads it
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:  # nested far beyond MAX_JSON_DEPTH: the decoder's own limit
        raise bad_request(_TOO_DEEP) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {json_type(body)}")
    # the walk is needed only where the text could break a rule (cheap scans of the text first)
    deep = text.count("[") + text.count("{") > MAX_JSON_DEPTH
    if deep or _SURROGATE_ESCAPE.search(text) is not None or has_surrogate(text):
        check_json_values(body)
    return body


def check_json_values(body: dict[str, Any]) -> None:
    """Walk a decoded body once, iteratively: nesting within MAX_JSON_DEPTH, no string (value or
    key) holding a lone surrogate. A surrogate is refused naming its path (`messages[0].content`),
    too deep a value naming the body field it is in (`prompt`)."""
    # (value, its depth, its path, the body field it is in)
    stack: list[tuple[Any, int, str | None, str | None]] = [(body, 1, None, None)]
    while stack:
        value, depth, path, top = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(_TOO_DEEP, top)
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(key, str) and has_surrogate(key):
                raise bad_request(f"an object key in {path or 'the request body'} {_NOT_TEXT}", path)
            if isinstance(item, str):
                if has_surrogate(item):
                    where = _path(path, key)
                    raise bad_request(f"{where} {_NOT_TEXT}", where)
            elif isinstance(item, (dict, list)):
                where = _path(path, key)
                stack.append((item, depth + 1, where, top or where))


_NOT_TEXT = "is not text: it holds a lone UTF-16 surrogate (U+D800..U+DFFF)"


def _path(parent: str | None, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def get(body: dict[str, Any], name: str, kind: str, default: Any = None) -> Any:
    """body[name] checked against a JSON kind: bool, int, number, str, list, dict. null = absent."""
    v = body.get(name)
    if v is None:
        return default
    ok = {
        "bool": isinstance(v, bool),
        "int": isinstance(v, int) and not isinstance(v, bool),
        "number": isinstance(v, (int, float)) and not isinstance(v, bool),
        "str": isinstance(v, str),
        "list": isinstance(v, list),
        "dict": isinstance(v, dict),
    }[kind]
    if not ok:
        raise bad_request(f"'{name}' must be {_KIND_NAMES[kind]}, got {json_type(v)}", name)
    return v


def beam_fields(body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """vLLM's beam-search extras as SamplingParams fields: `use_beam_search` (`n` is the beam
    width), `length_penalty` (a number) and `early_stopping` (true, false or "never").

    The two knobs change only beam search, so without `use_beam_search` a value other than the
    default is refused (vLLM 0.5's rule) rather than accepted and ignored. A beam-search answer
    exists only once every beam has finished (the best beam can change until the last step), so
    a streamed beam-search request is refused, naming `stream`. The other rules (greedy only, no
    logprobs or stop strings, n <= MAX_BEAM_WIDTH) are SamplingParams'."""
    beam = get(body, "use_beam_search", "bool", False)
    length_penalty = get(body, "length_penalty", "number")
    early = body.get("early_stopping")
    if early is not None and not (isinstance(early, bool) or early == "never"):
        shown = repr(early[:40]) if isinstance(early, str) else json_type(early)
        raise bad_request(f"'early_stopping' must be true, false or \"never\", got {shown}", "early_stopping")
    if not beam:
        if length_penalty is not None and length_penalty != 1:
            raise bad_request(
                "length_penalty only applies to beam search: set use_beam_search to true", "length_penalty"
            )
        if early:  # true or "never"
            raise bad_request(
                "early_stopping only applies to beam search: set use_beam_search to true", "early_stopping"
            )
        return {}
    if stream:
        raise bad_request(
            "beam search cannot be streamed: its beams are returned when they are all complete; set stream to false",
            "stream",
        )
    fields: dict[str, Any] = {"use_beam_search": True}
    if length_penalty is not None:
        fields["length_penalty"] = length_penalty
    if early is not None:
        fields["early_stopping"] = early
    return fields


def sample_fields(body: dict[str, Any], chat: bool, stream: bool) -> tuple[dict[str, Any], ShownLogprobs]:
    """`n`, `best_of` and the logprob fields as SamplingParams fields, and what the answer shows.

    Completions: `logprobs` is the top-k per token (0..MAX_LOGPROBS); with `echo` the prompt's
    tokens are scored too (`prompt_logprobs` = logprobs). Chat: `logprobs` is a boolean and
    `top_logprobs` the top-k (0..MAX_LOGPROBS, only with logprobs: vLLM's rule). Ranges of n,
    best_of and completions' logprobs are SamplingParams' (a 400 naming the field); a best_of above n cannot
    be streamed (its samples are ranked once all have finished), as OpenAI and vLLM refuse it."""
    fields: dict[str, Any] = {}
    n = get(body, "n", "int")
    best_of = get(body, "best_of", "int")
    if n is not None:
        fields["n"] = n
    if best_of is not None:
        fields["best_of"] = best_of
        if stream and best_of > (1 if n is None else n):
            raise bad_request(
                f"best_of={best_of} > n cannot be streamed; set stream to false or best_of to n", "best_of"
            )
    shown = ShownLogprobs()
    if chat:
        top = get(body, "top_logprobs", "int")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        if get(body, "logprobs", "bool", False):
            shown.top = top or 0
            fields["logprobs"] = shown.top
        elif top:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    else:
        shown.echo = get(body, "echo", "bool", False)
        k = get(body, "logprobs", "int")
        if k is not None:  # SamplingParams checks the range, naming `logprobs`
            shown.top = fields["logprobs"] = k
    return fields, shown


def sampling_fields(body: dict[str, Any], chat: bool, stream: bool) -> tuple[dict[str, Any], str, ShownLogprobs]:
    """The SamplingParams fields the body sets (JSON types checked, values not), the name the
    client used for the token limit (`max_completion_tokens` wins over `max_tokens`) and the
    logprobs the answer shows."""
    beam = beam_fields(body, stream)
    fields, shown = sample_fields(body, chat, stream)
    if beam and chat and "logprobs" in fields:  # SamplingParams would report chat's `true` as 0
        raise bad_request("logprobs is not supported with use_beam_search", "logprobs")
    fields.update(beam)
    max_tokens, max_name = get(body, "max_completion_tokens", "int"), "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_name = get(body, "max_tokens", "int"), "max_tokens"
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    for name, kind in SAMPLING_FIELDS:
        v = get(body, name, kind)
        if v is not None:
            fields[name] = v
    stop = body.get("stop")
    if stop is not None:
        if not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
            raise bad_request("'stop' must be a string or an array of strings", "stop")
        stop = [stop] if isinstance(stop, str) else stop
        if stop:  # [] is no stop string; [""] is refused by SamplingParams
            fields["stop"] = stop
    if "prompt_logprobs" in fields:
        if stream:  # as vLLM: they would all come with the first chunk
            raise bad_request("prompt_logprobs cannot be streamed; set stream to false", "prompt_logprobs")
        shown.prompt = True
    elif shown.echo and shown.top is not None:
        fields["prompt_logprobs"] = shown.top
    structured, _ = structured_outputs_of(body)
    if structured is not None:
        fields["structured_outputs"] = structured
    return fields, max_name, shown


def request_options(parsed: ParsedRequest, body: dict[str, Any], chat: bool) -> ParsedRequest:
    """What the body asks of the answer beyond sampling (both endpoints; `parsed` is changed
    and returned): the structured-output field's name, continuous usage, add_special_tokens,
    the client's request_id, return_tokens_as_token_ids."""
    parsed.structured_param = structured_outputs_of(body)[1]
    opts = get(body, "stream_options", "dict") or {}
    parsed.continuous_usage = get(opts, "continuous_usage_stats", "bool", False)
    if parsed.continuous_usage and not parsed.include_usage:
        raise bad_request("stream_options.continuous_usage_stats needs stream_options.include_usage", "stream_options")
    parsed.add_special_tokens = get(body, "add_special_tokens", "bool", not chat)
    rid = get(body, "request_id", "str")
    if rid is not None and not (0 < len(rid) <= MAX_REQUEST_ID and rid.isprintable()):
        raise bad_request(f"request_id must be 1 to {MAX_REQUEST_ID} printable characters", "request_id")
    parsed.request_id = rid
    parsed.shown.as_token_ids = get(body, "return_tokens_as_token_ids", "bool", False)
    if parsed.shown.as_token_ids and parsed.shown.top is None and not parsed.shown.prompt:
        raise bad_request(
            "return_tokens_as_token_ids needs logprobs (or prompt_logprobs)", "return_tokens_as_token_ids"
        )
    return parsed


def check_model(body: dict[str, Any], served_model_names: Sequence[str]) -> str:
    """The name the answer carries: the body's `model` when it is one of the served names (any
    of them: `--served-model-name` may give several), the first served name when it is absent."""
    model = get(body, "model", "str")
    if model is None:
        return served_model_names[0]
    if model not in served_model_names:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves {', '.join(repr(n) for n in served_model_names)}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
    return str(model)


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage); stream_options without stream is a client mistake."""
    stream = get(body, "stream", "bool", False)
    opts = get(body, "stream_options", "dict")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        include_usage = get(opts, "include_usage", "bool", False)
    return stream, include_usage


def completion_prompts(body: dict[str, Any]) -> list[Any]:
    """OpenAI's prompt forms: a string, an array of strings, an array of token ids, an array of
    arrays of token ids."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all_ints(prompt):
            return [prompt]
        if all(isinstance(p, list) and p and all_ints(p) for p in prompt):
            return list(prompt)
    raise bad_request(
        "'prompt' must be a string, an array of strings, an array of token ids or an array of "
        "arrays of token ids (none of them empty)",
        "prompt",
    )


def parse_completion(body: dict[str, Any], served_model_names: Sequence[str]) -> ParsedRequest:
    model = check_model(body, served_model_names)
    stream, include_usage = stream_flags(body)
    fields, max_name, shown = sampling_fields(body, chat=False, stream=stream)
    prompts = completion_prompts(body)
    parsed = ParsedRequest(prompts, fields, stream, include_usage, "prompt", max_name, fields.get("n", 1), shown, model)
    return request_options(parsed, body, chat=False)
