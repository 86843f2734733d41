"""The request fields /v1/completions and /v1/chat/completions know, and what each does here.

Every field OpenAI documents for the two endpoints and every extra vLLM's server accepts is in
REQUEST_FIELDS, with one of three statuses:
- HONOURED: it changes the answer as OpenAI / vLLM document it (parsing.py or chat.py reads it);
- IGNORED: accepted and without effect, as vLLM accepts it, because it carries nothing a local
  server could act on (an end-user id, storage and billing hints);
- REFUSED: a value other than the default (`accepted`) is a 400 naming the field.

A body key that is in none of the endpoint's fields is logged at warning level once per name for
the life of the `UnknownFields` that saw it (one per server) and otherwise ignored, as vLLM
does: OpenAI's clients send new fields before servers know them.

The field table of docs/server.md is `markdown_table()` (tests/server/test_request_fields.py checks that
docs/server.md holds exactly this table).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pagedllm.entrypoints.openai.errors import bad_request

logger = logging.getLogger("pagedllm")

Endpoint = Literal["completions", "chat"]
HONOURED, IGNORED, REFUSED = "honoured", "ignored", "refused"
BOTH: tuple[Endpoint, ...] = ("completions", "chat")
CMPL: tuple[Endpoint, ...] = ("completions",)
CHAT: tuple[Endpoint, ...] = ("chat",)


@dataclass(frozen=True)
class RequestField:
    name: str
    endpoints: tuple[Endpoint, ...]
    status: str
    meaning: str
    vllm: str = ""  # vLLM's name or behaviour where it differs from ours
    accepted: tuple[Any, ...] = ()  # REFUSED: the values that are not refused (null always is)


def _f(
    name: str, endpoints: tuple[Endpoint, ...], status: str, meaning: str, vllm: str = "", *accepted: Any
) -> RequestField:
    return RequestField(name, endpoints, status, meaning, vllm, tuple(accepted))


_STRUCTURED = "structured output (one such field per request)"
REQUEST_FIELDS: tuple[RequestField, ...] = (
    # ---- the request itself ----
    _f("model", BOTH, HONOURED, "one of the served names; the answer carries it"),
    _f("prompt", CMPL, HONOURED, "a string, strings, token ids or lists of token ids"),
    _f("messages", CHAT, HONOURED, "the conversation, rendered by the chat template (text content only)"),
    _f("stream", BOTH, HONOURED, "server-sent events"),
    _f("stream_options", BOTH, HONOURED, "`include_usage`; `continuous_usage_stats`: usage on every chunk"),
    _f("request_id", BOTH, HONOURED, "the answer's id is `cmpl-<request_id>` / `chatcmpl-<request_id>`"),
    # ---- sampling ----
    _f("temperature", BOTH, HONOURED, "0 is greedy"),
    _f("top_p", BOTH, HONOURED, "nucleus sampling"),
    _f("top_k", BOTH, HONOURED, "-1 or 0: off"),
    _f("min_p", BOTH, HONOURED, "drop tokens below min_p x the top probability"),
    _f("seed", BOTH, HONOURED, "reproducible sampling (sample i of a request uses seed + i)"),
    _f("n", BOTH, HONOURED, "choices per prompt"),
    _f("best_of", BOTH, HONOURED, "sample this many, return the n with the best cumulative logprob"),
    _f("presence_penalty", BOTH, HONOURED, "subtract from the logit of every token already generated"),
    _f("frequency_penalty", BOTH, HONOURED, "subtract x the count of each token already generated"),
    _f("repetition_penalty", BOTH, HONOURED, "divide / multiply the logits of prompt and output tokens (1: off)"),
    _f("logit_bias", BOTH, HONOURED, "token id (a JSON string key) -> bias added to its logit, clamped to [-100, 100]"),
    _f("allowed_token_ids", BOTH, HONOURED, "only these token ids may be sampled"),
    _f("bad_words", BOTH, HONOURED, "never generate these words (with and without a leading space)"),
    _f("use_beam_search", BOTH, HONOURED, "beam search, n beams (vLLM 0.5's extra)"),
    _f("length_penalty", BOTH, HONOURED, "beam search's length penalty"),
    _f("early_stopping", BOTH, HONOURED, 'beam search\'s stopping rule: true, false or "never"'),
    # ---- length and stopping ----
    _f("max_tokens", BOTH, HONOURED, "completion tokens at most; prompt + max_tokens past the context is a 400"),
    _f("max_completion_tokens", BOTH, HONOURED, "OpenAI's newer name of max_tokens (wins over it)"),
    _f("min_tokens", BOTH, HONOURED, "no EOS, stop token or stop string before this many tokens"),
    _f("stop", BOTH, HONOURED, "stop strings, cut from the text"),
    _f("stop_token_ids", BOTH, HONOURED, "stop tokens; their text is left out of the answer"),
    _f("ignore_eos", BOTH, HONOURED, "keep generating past EOS"),
    _f("include_stop_str_in_output", BOTH, HONOURED, "keep the matched stop string (or stop token's text) in the text"),
    # ---- text of the answer ----
    _f("skip_special_tokens", BOTH, HONOURED, "false: special tokens' text stays in the answer"),
    _f(
        "spaces_between_special_tokens",
        BOTH,
        HONOURED,
        "with skip_special_tokens false: a space around each special token's text (HF's slow decode)",
        "vLLM's fast-tokenizer path writes no spaces either way",
    ),
    _f("echo", CMPL, HONOURED, "the prompt precedes each choice's text (and logprobs)"),
    _f("logprobs", BOTH, HONOURED, "completions: top-k per token (0..20); chat: true for logprobs"),
    _f("top_logprobs", CHAT, HONOURED, "chat: the top-k per token (0..20), with logprobs"),
    _f("prompt_logprobs", BOTH, HONOURED, "top-k logprobs of every prompt token, in `prompt_logprobs` (not streamed)"),
    _f("return_tokens_as_token_ids", BOTH, HONOURED, 'logprobs\' tokens written as "token_id:N" (needs logprobs)'),
    # ---- the prompt ----
    _f(
        "add_special_tokens",
        BOTH,
        HONOURED,
        "add the tokenizer's special tokens (BOS...); default true on completions, false on chat",
    ),
    _f("truncate_prompt_tokens", BOTH, HONOURED, "keep only the prompt's last k tokens (-1: the context length)"),
    _f("cache_salt", BOTH, HONOURED, "only requests with the same salt share prefix-cache blocks"),
    _f(
        "split_special_tokens", CHAT, HONOURED, "false: special-token text typed in a message becomes the control token"
    ),
    _f(
        "chat_template",
        CHAT,
        HONOURED,
        "a Jinja template for this request (only with `--trust-request-chat-template`, else a 400)",
    ),
    _f("chat_template_kwargs", CHAT, HONOURED, "extra variables for the chat template"),
    _f("add_generation_prompt", CHAT, HONOURED, "open the assistant's turn (default true)"),
    _f("continue_final_message", CHAT, HONOURED, "continue the last (assistant) message instead of opening a turn"),
    _f("documents", CHAT, HONOURED, "documents for a template that renders them (RAG)"),
    # ---- tools ----
    _f("tools", CHAT, HONOURED, "functions the model may call; answers carry `tool_calls`"),
    _f("tool_choice", CHAT, HONOURED, '"none", "auto", "required" or a named function'),
    _f("parallel_tool_calls", CHAT, HONOURED, "false: at most one tool call"),
    _f("functions", CHAT, HONOURED, "OpenAI's legacy form of tools (answers carry `tool_calls`, not `function_call`)"),
    _f("function_call", CHAT, HONOURED, "OpenAI's legacy form of tool_choice"),
    # ---- structured output ----
    _f("response_format", BOTH, HONOURED, f'{{"type": "text" | "json_object" | "json_schema"}}: {_STRUCTURED}'),
    _f(
        "structured_outputs",
        BOTH,
        HONOURED,
        f"{{json | regex | choice | grammar | json_object, disable_any_whitespace}}: {_STRUCTURED}",
    ),
    _f("guided_json", BOTH, HONOURED, f"a JSON schema: {_STRUCTURED}", "older vLLM name of structured_outputs.json"),
    _f(
        "guided_regex",
        BOTH,
        HONOURED,
        f"a regular expression: {_STRUCTURED}",
        "older vLLM name of structured_outputs.regex",
    ),
    _f(
        "guided_choice",
        BOTH,
        HONOURED,
        f"one of these strings: {_STRUCTURED}",
        "older vLLM name of structured_outputs.choice",
    ),
    _f(
        "guided_grammar",
        BOTH,
        HONOURED,
        f"a Lark grammar (llguidance's dialect): {_STRUCTURED}",
        "older vLLM name of structured_outputs.grammar",
    ),
    _f("guided_decoding_backend", BOTH, HONOURED, '"guidance" or "auto" (llguidance); any other backend is a 400'),
    # ---- accepted and ignored, as vLLM accepts them ----
    _f("user", BOTH, IGNORED, "an end-user id for OpenAI's abuse monitoring"),
    _f("metadata", CHAT, IGNORED, "tags for OpenAI's stored completions"),
    _f("store", CHAT, IGNORED, "store the completion on OpenAI's side"),
    _f("service_tier", CHAT, IGNORED, "OpenAI's processing tier"),
    _f("safety_identifier", CHAT, IGNORED, "an end-user id for OpenAI's abuse monitoring"),
    _f("prompt_cache_key", CHAT, IGNORED, "OpenAI's cache routing hint (prefix caching here is automatic)"),
    _f("prediction", CHAT, IGNORED, "OpenAI's predicted output: a speed hint that does not change the answer"),
    # ---- refused unless left at their default ----
    _f("suffix", CMPL, REFUSED, "text after the completion (insertion)", "", ""),
    _f("priority", BOTH, REFUSED, "there is no priority scheduler: only 0", "", 0),
    _f("guided_whitespace_pattern", BOTH, REFUSED, "whitespace in JSON is off (disable_any_whitespace)"),
    _f("logits_processors", BOTH, REFUSED, "no logits-processor plugins"),
    _f("vllm_xargs", BOTH, REFUSED, "no extensions read them"),
    _f("kv_transfer_params", BOTH, REFUSED, "no disaggregated serving"),
    _f("prompt_embeds", CMPL, REFUSED, "prompts are token ids or text"),
    _f("mm_processor_kwargs", CHAT, REFUSED, "text-only models"),
    _f("structural_tag", CHAT, REFUSED, "structural tags are not supported"),
    _f("echo", CHAT, REFUSED, "chat: prepend the last message to the answer", "", False),
    _f("reasoning_effort", CHAT, REFUSED, "no reasoning models or parser"),
    _f("include_reasoning", CHAT, REFUSED, "no reasoning parser: answers have no reasoning_content", "", True),
    _f("modalities", CHAT, REFUSED, "text output only", "", ["text"]),
    _f("audio", CHAT, REFUSED, "text output only"),
    _f("web_search_options", CHAT, REFUSED, "no web search"),
    _f("verbosity", CHAT, REFUSED, "OpenAI's reasoning-model verbosity"),
)


def fields_of(endpoint: Endpoint) -> dict[str, RequestField]:
    return {f.name: f for f in REQUEST_FIELDS if endpoint in f.endpoints}


_BY_ENDPOINT: dict[str, dict[str, RequestField]] = {e: fields_of(e) for e in BOTH}


class UnknownFields:
    """Warns once per unknown field name for its own life (one per server: no module state)."""

    def __init__(self) -> None:
        self.warned: set[str] = set()

    def check(self, body: dict[str, Any], endpoint: Endpoint) -> None:
        """Refuse a REFUSED field set to anything but its default; warn of unknown names."""
        known = _BY_ENDPOINT[endpoint]
        for name, value in body.items():
            f = known.get(name)
            if f is None:
                if name not in self.warned:
                    self.warned.add(name)
                    logger.warning("/v1/%s: the request field %r is unknown and was ignored", _path(endpoint), name)
                continue
            if f.status == REFUSED and value is not None and not any(_same(value, a) for a in f.accepted):
                raise bad_request(f"{name} is not supported: {f.meaning}", name)


def _same(value: Any, accepted: Any) -> bool:
    return type(value) is type(accepted) and value == accepted


def _path(endpoint: Endpoint) -> str:
    return "completions" if endpoint == "completions" else "chat/completions"


def markdown_table(fields: Iterable[RequestField] = REQUEST_FIELDS) -> str:
    """docs/server.md's table: one row per field name, its endpoints, status and meaning."""
    rows = ["| field | endpoints | status | meaning |", "| --- | --- | --- | --- |"]
    for f in fields:
        where = "both" if f.endpoints == BOTH else ("completions" if f.endpoints == CMPL else "chat")
        meaning = f.meaning + (f" ({f.vllm})" if f.vllm else "")
        if f.status == REFUSED and f.accepted:
            meaning += "; accepted: " + ", ".join(f"`{json.dumps(a)}`" for a in f.accepted)  # as JSON spells it
        rows.append(f"| `{f.name}` | {where} | {f.status} | {meaning.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)
