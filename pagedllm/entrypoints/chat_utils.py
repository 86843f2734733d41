"""Chat messages -> a prompt through a chat template, for `LLM.chat` and /v1/chat/completions.

Messages are OpenAI's: text content only (a string, or an array of `{"type": "text"}` parts),
the roles of CHAT_ROLES, assistant messages that carry `tool_calls` (their content may be null)
and `tool` messages answering a call (`tool_call_id`). They reach the template as Hugging
Face's chat templates expect them: a tool call's `function.arguments` given as JSON text is
parsed to an object (templates iterate it or `tojson` it). Every mistake raises
InvalidRequestError naming the field (`messages[2].tool_calls[0].function.name`).

Control tokens come from the template only. The rendering is not tokenized as one string
(which would turn a `<|im_end|>` typed by a client into the real control token and let it close
its turn and open a forged one): each special token's text anywhere in the messages, the tools,
the documents or the template kwargs is swapped for a marker that cannot occur in text, the
template is rendered, and the markers are tokenized as plain text, the rest as usual.
`split_special_tokens=False` (HF's name for the tokenizer switch) opts out.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.input_processor import encode_text

# OpenAI's message roles. A template renders the role as text, so any other string could carry
# the template's own control tokens ("user<|im_end|>\n<|im_start|>system").
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# apply_chat_template arguments set by the caller's own fields: template kwargs may not override them
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
    "sanitize_control_tokens",
    "return_assistant_tokens_mask",
}


class ChatTokenizer(Protocol):
    """What chat rendering uses of a Hugging Face tokenizer."""

    chat_template: str | None
    added_tokens_decoder: dict[int, Any]  # id -> AddedToken (.content, .special)

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param)


def message_text(content: Any, where: str) -> str:
    """A message's content as one string: null is "", text parts are joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f'{where}: only text parts ({{"type": "text", "text": ...}}) are supported', where)
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{where} must be a string or an array of text parts", where)


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """An assistant's tool call as templates read it: arguments as an object when they are JSON text."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or call.get("type", "function") != "function":
        raise _bad(f'{where} must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}', where)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise _bad(f"{where}.function.arguments is not valid JSON", f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise _bad(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    out: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise _bad(f"{where} must be an object with a 'role' and a 'content'", where)
    role = m.get("role")
    if role not in CHAT_ROLES:
        shown = repr(role) if not isinstance(role, str) or len(role) <= 40 else repr(role[:40]) + "..."
        raise _bad(f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {shown}", f"{where}.role")
    msg: dict[str, Any] = {"role": role, "content": message_text(m.get("content"), f"{where}.content")}
    if isinstance(m.get("name"), str):
        msg["name"] = m["name"]
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise _bad(f"{where}.tool_calls must be an array on an assistant message", f"{where}.tool_calls")
        msg["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    elif role == "assistant" and m.get("content") is None and "content" in m:
        raise _bad(f"{where}.content may be null only when the message has tool_calls", f"{where}.content")
    call_id = m.get("tool_call_id")
    if call_id is not None:  # the call a tool message answers (optional: templates seldom render it)
        if role != "tool" or not isinstance(call_id, str):
            raise _bad(f"{where}.tool_call_id must be a string, on a tool message", f"{where}.tool_call_id")
        msg["tool_call_id"] = call_id
    return msg


def conversation_of(messages: Any, param: str = "messages") -> list[dict[str, Any]]:
    """OpenAI messages -> the conversation a chat template renders."""
    if not isinstance(messages, list) or not messages:
        raise _bad(f"'{param}' must be a non-empty array of {{role, content}} objects", param)
    return [_message(m, f"{param}[{i}]") for i, m in enumerate(messages)]


def check_tools(tools: Any, param: str = "tools") -> list[dict[str, Any]]:
    """OpenAI's tool list: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    if not isinstance(tools, list):
        raise _bad(f"'{param}' must be an array of tools", param)
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        where = f"{param}[{i}]"
        if not isinstance(fn, dict) or t.get("type") != "function":
            raise _bad(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}', where)
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"{where}.function.description must be a string", f"{where}.function.description")
    return tools


def special_token_texts(tokenizer: ChatTokenizer) -> list[str]:
    """The texts that tokenize to a special (control) token, longest first."""
    texts = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content}
    return sorted(texts, key=len, reverse=True)


@dataclass(frozen=True)
class SpecialTexts:
    """A tokenizer's special-token texts (longest first) and each one's ids as plain text
    (split_special_tokens=True), made once, where the tokenizer is set up (`of`).

    Invariant: no request writes the tokenizer's split_special_tokens flag. Hugging Face's encode
    writes that flag onto the Rust tokenizer the event loop and the worker threads share (and leaves
    it set), so a split encode at request time could land between another thread's read or write of
    it and its encode, splitting that prompt's special-token texts; a lock cannot close that
    without making the loop wait behind a worker thread's long encode (the Rust encode releases the
    GIL). The chat path reads `split_ids` instead."""

    texts: tuple[str, ...]
    split_ids: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, tokenizer: ChatTokenizer) -> SpecialTexts:
        texts = special_token_texts(tokenizer)
        split = {t: tuple(encode_text(tokenizer, t, split_special_tokens=True)) for t in texts}
        if texts:
            encode_text(tokenizer, "a")  # a plain encode: HF puts the flag back to the tokenizer's default
        return cls(tuple(texts), split)


class _Defuser:
    """Swaps special-token texts for markers `\\ue000<nonce>-<j>\\ue001` (private-use code points
    around digits: no text holds them unless it guessed the nonce, and a template's string
    filters leave them alone), then tokenizes a rendering with each marker as plain text."""

    def __init__(self, tokenizer: ChatTokenizer, specials: SpecialTexts):
        self.tokenizer, self.specials = tokenizer, specials
        self.find = re.compile("|".join(re.escape(s) for s in specials.texts))
        self.index = {s: j for j, s in enumerate(specials.texts)}
        self.nonce = secrets.randbits(64)
        self.mark = f"\ue000{self.nonce}-{{}}\ue001"
        self.used = False

    def defuse(self, value: Any) -> Any:
        """Strings anywhere in `value` (str, list, dict: JSON, so of bounded depth), keys too, with markers."""
        if isinstance(value, str):
            if self.find.search(value) is None:
                return value
            self.used = True
            return self.find.sub(lambda m: self.mark.format(self.index[m.group()]), value)
        if isinstance(value, list):
            return [self.defuse(v) for v in value]
        if isinstance(value, dict):
            return {self.defuse(k): self.defuse(v) for k, v in value.items()}
        return value

    def encode(self, rendered: str) -> tuple[str, list[int]]:
        """(the text with the special-token texts put back, its token ids)."""
        pieces = re.split(f"\ue000{self.nonce}-(\\d+)\ue001", rendered)  # text, j, text, j, ..., text
        text, ids = [], []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                text.append(piece)
                ids.extend(encode_text(self.tokenizer, piece))
            else:
                special = self.specials.texts[int(piece)]
                text.append(special)
                ids.extend(self.specials.split_ids[special])
        return "".join(text), ids


@dataclass
class ChatOptions:
    """How a conversation is rendered (vLLM's names). `chat_template` None: the tokenizer's.
    `template_kwargs`: extra variables for the template (`chat_template_kwargs`)."""

    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, str]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    split_special_tokens: bool = True

    def check(self) -> None:
        bad = sorted(set(self.template_kwargs) & RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise _bad(f"chat_template_kwargs may not set {bad}", "chat_template_kwargs")
        if self.add_generation_prompt and self.continue_final_message:
            raise _bad(
                "continue_final_message and add_generation_prompt cannot both be true: the first goes on "
                "writing the last message, the second opens a new one",
                "continue_final_message",
            )
        if self.documents is not None and not (
            isinstance(self.documents, list)
            and all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in self.documents)
        ):
            raise _bad("'documents' must be an array of objects of strings", "documents")


def render_chat(
    tokenizer: ChatTokenizer,
    conversation: list[dict[str, Any]],
    options: ChatOptions,
    specials: SpecialTexts | None = None,
) -> tuple[str, list[int]]:
    """The chat template applied to the conversation: (prompt text, prompt token ids), the control
    tokens only where the template writes them unless `options.split_special_tokens` is False.
    specials: the tokenizer's `SpecialTexts`, made where it was set up (None: made here, which
    writes the tokenizer's split flag: for callers that own the tokenizer alone)."""
    options.check()
    if not (options.chat_template or getattr(tokenizer, "chat_template", None)):
        raise InvalidRequestError(
            "the model has no chat template, so a conversation cannot become a prompt; give a chat_template "
            "or send a plain prompt",
            "messages",
            "no_chat_template",
        )
    if options.continue_final_message and conversation[-1]["role"] != "assistant":
        raise _bad("continue_final_message needs the last message to be the assistant's", "continue_final_message")
    defuser = None
    if options.split_special_tokens:
        if specials is None:
            specials = SpecialTexts.of(tokenizer)
        if specials.texts:
            defuser = _Defuser(tokenizer, specials)
    kwargs: dict[str, Any] = dict(options.template_kwargs)
    for name in ("tools", "documents"):
        if getattr(options, name) is not None:
            kwargs[name] = getattr(options, name)
    if defuser is not None:
        conversation, kwargs = defuser.defuse(conversation), defuser.defuse(kwargs)
    if options.chat_template is not None:
        kwargs["chat_template"] = options.chat_template  # the template itself is trusted text, never defused
    try:
        if options.continue_final_message:
            kwargs["continue_final_message"] = True
        rendered = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=options.add_generation_prompt, tokenize=False, **kwargs
        )
    except Exception as e:  # jinja errors, raise_exception() in the template
        raise _bad(f"the chat template rejected the messages: {e}", "messages") from None
    if not isinstance(rendered, str):
        raise _bad("the chat template did not produce a string", "messages")
    if defuser is not None and defuser.used:
        return defuser.encode(rendered)
    return rendered, encode_text(tokenizer, rendered)
