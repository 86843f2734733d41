"""Response objects and SSE events of /v1/completions and /v1/chat/completions.

A builder per endpoint turns the engine's RequestOutputs into OpenAI's shapes: the final JSON
object of a non-streamed request, and for a streamed one the opening event, one event per
output and the usage event. A mid-stream token event is formatted from a template made once per
request (`sse_template`), so a token costs one `json.dumps` of its text, not of the whole chunk.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from pagedllm.engine.outputs import RequestOutput

SSE_DONE = "data: [DONE]\n\n"
_HOLE = "\x00pagedllm-delta\x00"


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_template(obj: Any) -> tuple[str, str]:
    """The SSE text of `obj` split around its one `_HOLE` string: an event is then
    `head + json.dumps(text) + tail`."""
    head, tail = sse(obj).split(json.dumps(_HOLE, ensure_ascii=False))
    return head, tail


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseBuilder(Protocol):
    """What the serving layer needs of an endpoint's response shapes."""

    def opening(self) -> list[str]:
        """SSE events sent before the first output."""
        ...

    def events(self, index: int, out: RequestOutput) -> list[str]:
        """SSE events for one output of prompt `index`."""
        ...

    def usage_event(self, prompt_tokens: int, completion_tokens: int) -> str: ...

    def final(self, outs: list[RequestOutput], prompt_lens: list[int]) -> dict[str, Any]:
        """The JSON object of a non-streamed request."""
        ...


class _Chunks:
    """chunk(choices, usage) -> one response object; `usage` False leaves the key out, None
    writes `"usage": null` (streams with include_usage carry it on every chunk)."""

    def __init__(self, request_id: str, obj: str, created: int, model: str, include_usage: bool):
        self.request_id, self.obj, self.created, self.model = request_id, obj, created, model
        self.chunk_usage: Any = None if include_usage else False

    def chunk(self, choices: list[dict[str, Any]], usage: Any = False) -> dict[str, Any]:
        c = {"id": self.request_id, "object": self.obj, "created": self.created, "model": self.model}
        c["choices"] = choices
        if usage is not False:
            c["usage"] = usage
        return c

    def usage_event(self, prompt_tokens: int, completion_tokens: int) -> str:
        return sse(self.chunk([], usage(prompt_tokens, completion_tokens)))


class CompletionResponses(_Chunks):
    def __init__(self, request_id: str, created: int, model: str, include_usage: bool = False):
        super().__init__(request_id, "text_completion", created, model, include_usage)
        self.head, self.tail = sse_template(self.chunk([self._choice(0, _HOLE, None, None)], self.chunk_usage))

    @staticmethod
    def _choice(index: int, text: str, finish_reason: str | None, stop_reason: Any) -> dict[str, Any]:
        return {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def opening(self) -> list[str]:
        return []

    def events(self, index: int, out: RequestOutput) -> list[str]:
        o = out.outputs[0]
        if index == 0 and o.finish_reason is None:
            return [self.head + json.dumps(o.delta_text, ensure_ascii=False) + self.tail]
        choice = self._choice(index, o.delta_text, o.finish_reason, o.stop_reason)
        return [sse(self.chunk([choice], self.chunk_usage))]

    def final(self, outs: list[RequestOutput], prompt_lens: list[int]) -> dict[str, Any]:
        choices = [
            self._choice(i, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for i, o in enumerate(outs)
        ]
        return self.chunk(choices, usage(sum(prompt_lens), sum(len(o.outputs[0].token_ids) for o in outs)))


class ChatResponses(_Chunks):
    def __init__(self, request_id: str, created: int, model: str, include_usage: bool = False):
        super().__init__(request_id, "chat.completion.chunk", created, model, include_usage)
        self.head, self.tail = sse_template(self.chunk([self._choice({"content": _HOLE}, None)], self.chunk_usage))

    @staticmethod
    def _choice(delta: dict[str, Any], finish_reason: str | None, stop_reason: Any = None) -> dict[str, Any]:
        return {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def opening(self) -> list[str]:
        """The role comes first, on a chunk of its own."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [sse(self.chunk([choice], self.chunk_usage))]

    def events(self, index: int, out: RequestOutput) -> list[str]:
        o = out.outputs[0]
        if o.finish_reason is None:
            return [self.head + json.dumps(o.delta_text, ensure_ascii=False) + self.tail]
        delta = {"content": o.delta_text} if o.delta_text else {}
        return [sse(self.chunk([self._choice(delta, o.finish_reason, o.stop_reason)], self.chunk_usage))]

    def final(self, outs: list[RequestOutput], prompt_lens: list[int]) -> dict[str, Any]:
        o = outs[0].outputs[0]
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": o.text},
            "logprobs": None,
            "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason,
        }
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(prompt_lens[0], len(o.token_ids)),
        }
