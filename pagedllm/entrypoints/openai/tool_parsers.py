"""Tool calls out of a chat answer's text, whole (`extract`) and as a stream of deltas (`streamer`).

Three readers, one per `tool_choice`:
- `HermesToolCalls` ("auto", `--tool-call-parser hermes`): Hermes / Qwen models write each call
  as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the text outside the tags is the
  content (null when it is only whitespace). A block that is not such an object leaves the
  whole text as content and no calls (the model did not call a tool).
- `RequiredToolCalls` ("required"): the structured output is a JSON array
  `[{"name": ..., "parameters": {...}}, ...]` (tool_choice.py's schema).
- `NamedToolCall` (a named function): the whole structured output is that function's arguments.

A streamed call is sent as OpenAI sends it: a first delta with the call's `index`, `id`, `type`
and `function.name` (arguments ""), then deltas of `function.arguments` fragments whose
concatenation is the arguments' JSON text.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Protocol

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)$", re.S)  # an unclosed last block counts
# the head of a call object written name first: {"name": "f", "arguments":
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    """One entry of `message.tool_calls`."""
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _call_of(obj: Any, args_key: str = "arguments") -> dict[str, Any] | None:
    """{"name", "arguments"} (or "parameters") -> a tool call; None when `obj` is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        return tool_call(obj["name"], args)
    return tool_call(obj["name"], _dumps(args if args is not None else {}))


class ToolCallStream(Protocol):
    """One streamed choice's reader: text in, OpenAI delta objects out."""

    called: bool  # a tool call has been sent

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]: ...


class ToolCallReader(Protocol):
    """How a chat answer's text becomes (content, tool_calls) for one request."""

    finish_reason: str  # a choice that called a tool and stopped normally ends with this

    def extract(self, text: str) -> tuple[str | None, list[dict[str, Any]]]: ...

    def streamer(self) -> ToolCallStream: ...


class _JsonEnd:
    """Where a JSON object or array ends, fed piece by piece (strings and escapes respected)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def feed(self, s: str) -> int | None:
        """The index in `s` just past the value's closing bracket, or None if it has not closed."""
        for i, ch in enumerate(s):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def _deltas_of_call(index: int, call: dict[str, Any]) -> list[dict[str, Any]]:
    fn = call["function"]
    head = {"index": index, "id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}}
    deltas: list[dict[str, Any]] = [{"tool_calls": [head]}]
    if fn["arguments"]:
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": fn["arguments"]}}]})
    return deltas


class HermesToolCalls:
    finish_reason = "tool_calls"

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls  # parallel_tool_calls false: 1 (later calls are dropped)

    def extract(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        if TOOL_CALL_OPEN not in text:
            return text, []
        calls, outside, at = [], [], 0
        for m in _BLOCK.finditer(text):
            try:
                call = _call_of(json.loads((m.group(1) if m.group(1) is not None else m.group(2)).strip()))
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
            outside.append(text[at : m.start()])
            at = m.end()
        outside.append(text[at:])
        content = "".join(outside)
        return (content if content.strip() else None), calls[: self.max_calls]

    def streamer(self) -> ToolCallStream:
        return _HermesStream(self.max_calls)


class _HermesStream:
    """States: text (content, holding back a possible start of `<tool_call>`), head (the call's
    name not yet known), args (arguments streamed as they come), tail (up to `</tool_call>`)."""

    def __init__(self, max_calls: int | None):
        self.max_calls = max_calls
        self.state, self.buf, self.calls = "text", "", 0
        self.called = False
        self.scan = _JsonEnd()

    def _room(self) -> bool:
        return self.max_calls is None or self.calls < self.max_calls

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        self.buf += text
        out: list[dict[str, Any]] = []
        while True:
            before = (self.state, len(self.buf))
            getattr(self, f"_{self.state}")(out, final)
            if (self.state, len(self.buf)) == before:
                break
        if final:
            self._finish(out)
        return out

    def _text(self, out: list[dict[str, Any]], final: bool) -> None:
        k = self.buf.find(TOOL_CALL_OPEN)
        if k >= 0:
            self._content(out, self.buf[:k])
            self.buf, self.state = self.buf[k + len(TOOL_CALL_OPEN) :], "head"
            return
        keep = 0 if final else _partial_suffix(self.buf, TOOL_CALL_OPEN)
        self._content(out, self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]

    def _head(self, out: list[dict[str, Any]], final: bool) -> None:
        m = _HEAD.match(self.buf)
        if m is not None:
            if self._room():
                name = json.loads(f'"{m.group(1)}"')
                head = tool_call(name, "")
                out.extend(_deltas_of_call(self.calls, head))
                self.called = True
            self.buf, self.state, self.scan = self.buf[m.end() :], "args", _JsonEnd()
            return
        k = self.buf.find(TOOL_CALL_CLOSE)
        if k >= 0:  # a block not written name first: read it whole
            self._whole(out, self.buf[:k])
            self.buf, self.state = self.buf[k + len(TOOL_CALL_CLOSE) :], "text"

    def _args(self, out: list[dict[str, Any]], final: bool) -> None:
        if not self.buf:
            return
        end = self.scan.feed(self.buf)
        piece = self.buf if end is None else self.buf[:end]
        if self._room() and piece:
            out.append({"tool_calls": [{"index": self.calls, "function": {"arguments": piece}}]})
        self.buf = "" if end is None else self.buf[end:]
        if end is not None:
            self.calls += 1
            self.state = "tail"

    def _tail(self, out: list[dict[str, Any]], final: bool) -> None:
        k = self.buf.find(TOOL_CALL_CLOSE)
        if k >= 0:
            self.buf, self.state = self.buf[k + len(TOOL_CALL_CLOSE) :], "text"
        elif not final:
            self.buf = self.buf[len(self.buf) - _partial_suffix(self.buf, TOOL_CALL_CLOSE) :]

    def _whole(self, out: list[dict[str, Any]], body: str) -> None:
        try:
            call = _call_of(json.loads(body.strip()))
        except ValueError:
            call = None
        if call is None:
            self._content(out, TOOL_CALL_OPEN + body)
        elif self._room():
            out.extend(_deltas_of_call(self.calls, call))
            self.calls += 1
            self.called = True

    def _finish(self, out: list[dict[str, Any]]) -> None:
        if self.state == "head" and self.buf:  # an unclosed block at the end
            self._whole(out, self.buf)
        self.buf = ""

    @staticmethod
    def _content(out: list[dict[str, Any]], text: str) -> None:
        if text:
            out.append({"content": text})


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class RequiredToolCalls:
    finish_reason = "tool_calls"

    def extract(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        try:
            items = json.loads(text)
        except ValueError:  # cut short (length): no call to report
            return text, []
        calls = [_call_of(item, "parameters") for item in items] if isinstance(items, list) else [None]
        if any(c is None for c in calls):
            return text, []
        return None, [c for c in calls if c is not None]

    def streamer(self) -> ToolCallStream:
        return _RequiredStream()


class _RequiredStream:
    """Each element of the array is sent as one call once it is complete."""

    def __init__(self) -> None:
        self.called, self.calls = False, 0
        self.started, self.buf, self.scan = False, "", _JsonEnd()

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ch in text:
            if not self.started:
                self.started = ch == "{"
                if not self.started:
                    continue
            self.buf += ch
            if self.scan.feed(ch) is not None:
                try:
                    call = _call_of(json.loads(self.buf), "parameters")
                except ValueError:
                    call = None
                if call is not None:
                    out.extend(_deltas_of_call(self.calls, call))
                    self.calls, self.called = self.calls + 1, True
                self.started, self.buf, self.scan = False, "", _JsonEnd()
        return out


class NamedToolCall:
    finish_reason = "stop"  # OpenAI's finish_reason for a forced function

    def __init__(self, name: str):
        self.name = name

    def extract(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return None, [tool_call(self.name, text)]

    def streamer(self) -> ToolCallStream:
        return _NamedStream(self.name)


class _NamedStream:
    def __init__(self, name: str):
        self.name, self.called = name, False

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self.called:
            out.extend(_deltas_of_call(0, tool_call(self.name, "")))
            self.called = True
        if text:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out


TOOL_PARSERS = {"hermes": HermesToolCalls}  # --tool-call-parser NAME
