"""/v1/chat/completions bodies: the messages -> prompt token ids through the tokenizer's chat
template, then the same sampling fields as /v1/completions (`parsing.py`).

Only text content is accepted (a string, or an array of `{"type": "text"}` parts) and only
OpenAI's roles (CHAT_ROLES); a model without a chat template cannot serve /v1/chat/completions
(400 `no_chat_template`).

Control tokens come from the template only. The template's output is not tokenized as one
string (which would turn a `<|im_end|>` typed by a client into the real control token and let
it close its turn and open a forged one): each special token's text inside a message's content
(or a chat_template_kwargs string) is swapped for a marker that cannot occur in text, the
template is rendered, and the markers are tokenized as plain text, the rest as usual. A
request may opt out with `"split_special_tokens": false` (HF's name for the tokenizer switch).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from typing import Any, Protocol

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.parsing import ParsedRequest, check_model, get, sampling_fields, stream_flags

# OpenAI's message roles. A template renders the role as text, so any other string could carry
# the template's own control tokens ("user<|im_end|>\n<|im_start|>system").
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

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


class ChatTokenizer(Protocol):
    """What the chat endpoint uses of a Hugging Face tokenizer."""

    chat_template: str | None
    added_tokens_decoder: dict[int, Any]  # id -> AddedToken (.content, .special)

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


def message_text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f'messages[{i}].content: only text parts ({{"type": "text", "text": ...}}) are supported',
                    f"messages[{i}].content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or an array of text parts", f"messages[{i}].content")


def conversation_of(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of {role, content} objects", "messages")
    conversation = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object with a 'role' and a 'content'", f"messages[{i}]")
        role = m.get("role")
        if role not in CHAT_ROLES:
            shown = repr(role) if not isinstance(role, str) or len(role) <= 40 else repr(role[:40]) + "..."
            raise bad_request(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {shown}", f"messages[{i}].role"
            )
        conversation.append({"role": role, "content": message_text(m.get("content"), i)})
    return conversation


def special_token_texts(tokenizer: ChatTokenizer) -> list[str]:
    """The texts that tokenize to a special (control) token, longest first."""
    texts = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content}
    return sorted(texts, key=len, reverse=True)


class _Defuser:
    """Swaps special-token texts for markers `\\ue000<nonce>-<j>\\ue001` (private-use code points
    around digits: no text holds them unless it guessed the nonce, and a template's string
    filters leave them alone), then tokenizes a rendering with each marker as plain text."""

    def __init__(self, tokenizer: ChatTokenizer, specials: list[str]):
        self.tokenizer, self.specials = tokenizer, specials
        self.find = re.compile("|".join(re.escape(s) for s in specials))
        self.index = {s: j for j, s in enumerate(specials)}
        self.nonce = secrets.randbits(64)
        self.mark = f"\ue000{self.nonce}-{{}}\ue001"
        self.used = False

    def defuse(self, value: Any) -> Any:
        """Strings anywhere in `value` (str, list, dict: JSON, so of bounded depth) with markers."""
        if isinstance(value, str):
            if self.find.search(value) is None:
                return value
            self.used = True
            return self.find.sub(lambda m: self.mark.format(self.index[m.group()]), value)
        if isinstance(value, list):
            return [self.defuse(v) for v in value]
        if isinstance(value, dict):
            return {k: self.defuse(v) for k, v in value.items()}
        return value

    def tokenize(self, rendered: str) -> tuple[str, list[int]]:
        """(the text with the special-token texts put back, its token ids)."""
        pieces = re.split(f"\ue000{self.nonce}-(\\d+)\ue001", rendered)  # text, j, text, j, ..., text
        text, ids = [], []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                text.append(piece)
                ids.extend(self.tokenizer.encode(piece, add_special_tokens=False) if piece else [])
            else:
                special = self.specials[int(piece)]
                text.append(special)
                ids.extend(self.tokenizer.encode(special, add_special_tokens=False, split_special_tokens=True))
        return "".join(text), ids


def render_chat(
    tokenizer: ChatTokenizer, conversation: list[dict[str, str]], kwargs: dict[str, Any], split_special_tokens: bool
) -> tuple[str, list[int]]:
    """The chat template applied to the conversation: (prompt text, prompt token ids), the control
    tokens only where the template writes them unless `split_special_tokens` is False."""
    specials = special_token_texts(tokenizer) if split_special_tokens else []
    defuser = _Defuser(tokenizer, specials) if specials else None
    if defuser is not None:
        conversation = [{"role": m["role"], "content": defuser.defuse(m["content"])} for m in conversation]
        kwargs = defuser.defuse(kwargs)
    try:
        rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as e:  # jinja errors, raise_exception() in the template
        raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
    if not isinstance(rendered, str):
        raise bad_request("the chat template did not produce a string", "messages")
    if defuser is not None and defuser.used:
        return defuser.tokenize(rendered)
    return rendered, list(tokenizer.encode(rendered, add_special_tokens=False)) if rendered else []


def chat_prompt(body: dict[str, Any], tokenizer: Any, served_model_name: str) -> dict[str, Any]:
    """The prompt of a chat body: {"prompt": text, "prompt_token_ids": ids}."""
    conversation = conversation_of(body)
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
    split = get(body, "split_special_tokens", "bool", True)
    text, ids = render_chat(tokenizer, conversation, extra, split)
    return {"prompt": text, "prompt_token_ids": ids}


def parse_chat(body: dict[str, Any], served_model_names: Sequence[str], tokenizer: Any) -> ParsedRequest:
    """`prompts` is the one prompt the chat template makes of the messages, as text and token ids
    (the input processor checks the ids); a prompt error further in names `messages`."""
    model = check_model(body, served_model_names)
    stream, include_usage = stream_flags(body)
    prompt = chat_prompt(body, tokenizer, model)
    fields, max_name, shown = sampling_fields(body, chat=True, stream=stream)
    return ParsedRequest(
        [prompt], fields, stream, include_usage, "messages", max_name, fields.get("n", 1), shown, model
    )
