"""/v1/chat/completions bodies: the messages -> one prompt text through the tokenizer's chat
template, then the same sampling fields as /v1/completions (`parsing.py`).

Only text content is accepted (a string, or an array of `{"type": "text"}` parts); a model
without a chat template cannot serve /v1/chat/completions (400 `no_chat_template`).
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.parsing import ParsedRequest, check_model, get, sampling_fields, stream_flags

# apply_chat_template arguments the server sets itself: a client may not override them
RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "messages",
    "tokenize",
    "add_generation_prompt",
    "return_dict",
    "chat_template",
    "tools",
    "documents",
    "continue_final_message",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "tokenizer_kwargs",
}


def message_text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f'messages[{i}].content: only text parts ({{"type": "text", "text": ...}}) are supported',
                    "messages",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or an array of text parts", "messages")


def chat_prompt(body: dict[str, Any], tokenizer: Any, served_model_name: str) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of {role, content} objects", "messages")
    conversation = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", "messages")
        conversation.append({"role": m["role"], "content": message_text(m.get("content"), i)})
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request(
            f"the model '{served_model_name}' has no chat template, so /v1/chat/completions cannot "
            "build a prompt; use /v1/completions",
            "messages",
            "no_chat_template",
        )
    extra = get(body, "chat_template_kwargs", "dict", {})
    bad = sorted(set(extra) & RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {bad}", "chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **extra)
    except Exception as e:  # jinja errors, raise_exception() in the template
        raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
    if not isinstance(text, str):
        raise bad_request("the chat template did not produce a string", "messages")
    return text


def parse_chat(body: dict[str, Any], served_model_name: str, tokenizer: Any) -> ParsedRequest:
    """`prompts` is the one prompt text the chat template makes of the messages; a prompt error
    further in names `messages`."""
    check_model(body, served_model_name)
    stream, include_usage = stream_flags(body)
    text = chat_prompt(body, tokenizer, served_model_name)
    fields, max_name = sampling_fields(body, chat=True)
    return ParsedRequest([text], fields, stream, include_usage, "messages", max_name)
