"""/v1/chat/completions bodies: the messages (and tools) -> prompt token ids through the chat
template (`entrypoints/chat_utils.py`, which keeps control tokens out of client text), then the
same sampling fields as /v1/completions (`parsing.py`), and the tool choice (`tool_choice.py`).

Rendering fields (vLLM's): `chat_template` (a Jinja template for this request only: refused
unless the server trusts request templates, as vLLM's `--trust-request-chat-template`, since a
template is code the server runs), `add_generation_prompt` (default true),
`continue_final_message` (the answer goes on writing the last, assistant, message),
`documents`, `chat_template_kwargs`, `split_special_tokens` (HF's switch; false lets special-token
text in the messages become control tokens). A model without a chat template and no request
template cannot serve chat (400 `no_chat_template`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.entrypoints.chat_utils import CHAT_ROLES, ChatOptions, SpecialTexts, conversation_of, render_chat
from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.parsing import ParsedRequest, check_model, get, sampling_fields, stream_flags
from pagedllm.entrypoints.openai.tool_choice import TOOL_FIELDS, ToolUse, check_tools_400, tool_use
from pagedllm.entrypoints.openai.tool_parsers import ToolCallReader

__all__ = ["CHAT_ROLES", "ChatRequest", "parse_chat"]


@dataclass
class ChatRequest:
    """A parsed chat body and how its answer is read for tool calls (None: plain text)."""

    parsed: ParsedRequest
    tool_reader: ToolCallReader | None = None


def chat_options(body: dict[str, Any], tools: ToolUse, trust_request_chat_template: bool) -> ChatOptions:
    template = get(body, "chat_template", "str")
    extra = get(body, "chat_template_kwargs", "dict", {})
    if (template is not None or "chat_template" in extra) and not trust_request_chat_template:
        raise bad_request(
            "this server does not run chat templates sent with a request (it runs with its model's own "
            "template; --trust-request-chat-template allows them)",
            "chat_template",
        )
    return ChatOptions(
        chat_template=template,
        add_generation_prompt=get(body, "add_generation_prompt", "bool", True),
        continue_final_message=get(body, "continue_final_message", "bool", False),
        tools=tools.tools,
        documents=get(body, "documents", "list"),
        template_kwargs=extra,
        split_special_tokens=get(body, "split_special_tokens", "bool", True),
    )


def chat_prompt(
    body: dict[str, Any],
    tokenizer: Any,
    served_model_name: str,
    options: ChatOptions | None = None,
    specials: SpecialTexts | None = None,
) -> dict[str, Any]:
    """The prompt of a chat body: {"prompt": text, "prompt_token_ids": ids}; `options` None: the
    body's rendering fields with its tools offered and request templates refused (/tokenize).
    specials: the tokenizer's SpecialTexts, made at start-up (chat_utils.SpecialTexts)."""
    if options is None:
        tools = get(body, "tools", "list")
        options = chat_options(body, ToolUse(check_tools_400(tools) if tools else None), False)
    try:
        conversation = conversation_of(body.get("messages"))
        if tokenizer is None:
            raise InvalidRequestError("no tokenizer", "messages", "no_chat_template")
        text, ids = render_chat(tokenizer, conversation, options, specials)
    except InvalidRequestError as e:
        if e.code == "no_chat_template":
            raise bad_request(
                f"the model '{served_model_name}' has no chat template, so /v1/chat/completions cannot "
                "build a prompt; use /v1/completions",
                "messages",
                "no_chat_template",
            ) from None
        raise bad_request(e.message, e.param, e.code) from None
    return {"prompt": text, "prompt_token_ids": ids}


def parse_chat(
    body: dict[str, Any],
    served_model_names: Sequence[str],
    tokenizer: Any,
    *,
    tool_parser: str | None = None,
    trust_request_chat_template: bool = False,
    specials: SpecialTexts | None = None,
) -> ChatRequest:
    """`prompts` is the one prompt the chat template makes of the messages, as text and token ids
    (the input processor checks the ids); a prompt error further in names `messages`."""
    model = check_model(body, served_model_names)
    stream, include_usage = stream_flags(body)
    tools = tool_use(body, tool_parser)
    prompt = chat_prompt(body, tokenizer, model, chat_options(body, tools, trust_request_chat_template), specials)
    sampling_body = {k: v for k, v in body.items() if k not in TOOL_FIELDS}  # the tool fields are read above
    fields, max_name, shown = sampling_fields(sampling_body, chat=True, stream=stream)
    if tools.structured is not None:
        if "structured_outputs" in fields:
            raise bad_request(
                'tool_choice "required" or a named function is enforced with structured output, so it '
                "cannot be combined with response_format or another structured output",
                "tool_choice",
            )
        fields["structured_outputs"] = tools.structured
    parsed = ParsedRequest(
        [prompt], fields, stream, include_usage, "messages", max_name, fields.get("n", 1), shown, model
    )
    return ChatRequest(parsed, tools.reader)
