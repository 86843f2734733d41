"""Response objects and SSE events of /v1/completions and /v1/chat/completions.

A builder per endpoint turns the engine's RequestOutputs into OpenAI's shapes: the final JSON
object of a non-streamed request, and for a streamed one the opening event, one event per
output and the usage event. A mid-stream token event is formatted from a template made once per
request (`sse_template`), so a token costs one `json.dumps` of its text, not of the whole chunk;
a request with n > 1, logprobs or echo builds each choice's chunk (logprobs.py formats those).

Streams: every chunk holds one choice, with its `index`; each choice ends with a chunk of its
own finish_reason; a choice's logprobs cover only that chunk's tokens. With `echo` a choice's
first chunk starts with the prompt (and, with logprobs, the prompt's tokens).
`continuous_usage` (stream_options.continuous_usage_stats): every choice chunk carries the usage
so far of its choice (its prompt's tokens, its own tokens), as vLLM counts it.
Asked-for `prompt_logprobs` (not streamed) are in each completion choice and at the top of a
chat answer, as vLLM places them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from pagedllm.engine.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs
from pagedllm.entrypoints.openai.logprobs import (
    Entry,
    chat_logprobs,
    completion_logprobs,
    entries_of,
    prompt_logprobs_json,
)
from pagedllm.entrypoints.openai.parsing import ShownLogprobs
from pagedllm.entrypoints.openai.tool_parsers import ToolCallReader, ToolCallStream

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


class Texts:
    """Token ids -> text for what the output processor does not decode: a token's own text
    (a logprobs position without `decoded_token`) and an echoed prompt given as token ids."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode([token_id])

    def prompt(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return "" if self.tokenizer is None else self.tokenizer.decode(out.prompt_token_ids)


@dataclass
class _ChoiceState:
    """A streamed choice: what its chunks have carried so far."""

    echoed: bool = False
    finished: bool = False
    text_offset: int = 0  # completions logprobs: where the next token's text starts


class _Choices(_Chunks):
    """The per-choice bookkeeping both endpoints share. A prompt of index i has choices
    i * n .. i * n + n - 1 (vLLM's numbering); a streamed RequestOutput carries every sequence,
    and a choice gets a chunk when it has new tokens or text, or has just finished."""

    OBJECT: str  # the "object" of a streamed chunk

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        include_usage: bool = False,
        n: int = 1,
        shown: ShownLogprobs | None = None,
        texts: Texts | None = None,
        continuous_usage: bool = False,
    ):
        super().__init__(request_id, self.OBJECT, created, model, include_usage)
        self.n, self.shown, self.texts = n, shown or ShownLogprobs(), texts or Texts(None)
        self.continuous_usage = continuous_usage
        # the template path
        self.simple = n == 1 and self.shown.top is None and not self.shown.echo and not continuous_usage
        self.states: dict[int, _ChoiceState] = {}
        self.prompt_logprobs: dict[int, PromptLogprobs] = {}  # echo: by prompt index, once seen (streams)
        self.head, self.tail = self._template()

    def _template(self) -> tuple[str, str]:
        """The SSE text of a one-choice chunk around its content (the fast path of `simple`)."""
        raise NotImplementedError

    def usage_of(self, out: RequestOutput, o: CompletionOutput) -> Any:
        """A choice chunk's `usage`: the choice's so far with continuous usage, else chunk_usage."""
        if self.continuous_usage:
            return usage(len(out.prompt_token_ids), len(o.token_ids))
        return self.chunk_usage

    def prompt_logprobs_of(self, out: RequestOutput) -> Any:
        return prompt_logprobs_json(out.prompt_logprobs, self.texts.token, self.shown.as_token_ids)

    def changed(self, index: int, out: RequestOutput) -> list[tuple[int, _ChoiceState, CompletionOutput]]:
        """(choice index, its state, its output) of the choices with something to send."""
        todo = []
        for o in out.outputs:
            i = index * self.n + o.index
            st = self.states.get(i)
            if st is None:
                st = self.states[i] = _ChoiceState()
            if st.finished or not (o.delta_token_ids or o.delta_text or o.finish_reason is not None):
                continue
            st.finished = o.finish_reason is not None
            todo.append((i, st, o))
        return todo


class CompletionResponses(_Choices):
    OBJECT = "text_completion"

    def _template(self) -> tuple[str, str]:
        return sse_template(self.chunk([self._choice(0, _HOLE, None, None)], self.chunk_usage))

    @staticmethod
    def _choice(
        index: int, text: str, finish_reason: str | None, stop_reason: Any, logprobs: Any = None
    ) -> dict[str, Any]:
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def opening(self) -> list[str]:
        return []

    def _with_echo(
        self, out: RequestOutput, prompt_lps: PromptLogprobs | None, text: str, ids: list[int], entries: list[Entry]
    ) -> tuple[str, list[int], list[Entry]]:
        """The prompt's text, ids and entries before the choice's own."""
        p_ids = out.prompt_token_ids
        p_entries = list(prompt_lps) if prompt_lps is not None else [None] * len(p_ids)
        return self.texts.prompt(out) + text, [*p_ids, *ids], p_entries + entries

    def events(self, index: int, out: RequestOutput) -> list[str]:
        if self.simple:
            o = out.outputs[0]
            if index == 0 and o.finish_reason is None:
                return [self.head + json.dumps(o.delta_text, ensure_ascii=False) + self.tail]
            choice = self._choice(index, o.delta_text, o.finish_reason, o.stop_reason)
            return [sse(self.chunk([choice], self.chunk_usage))]
        if out.prompt_logprobs is not None:
            self.prompt_logprobs.setdefault(index, out.prompt_logprobs)
        events = []
        top = self.shown.top
        for i, st, o in self.changed(index, out):
            text, ids = o.delta_text, list(o.delta_token_ids)
            entries = entries_of(o.logprobs, len(ids)) if top is not None else []
            if self.shown.echo and not st.echoed:
                st.echoed = True
                text, ids, entries = self._with_echo(out, self.prompt_logprobs.get(index), text, ids, entries)
            lps = None
            if top is not None:
                lps, st.text_offset = completion_logprobs(
                    ids, entries, self.texts.token, st.text_offset, self.shown.as_token_ids
                )
            events.append(
                sse(self.chunk([self._choice(i, text, o.finish_reason, o.stop_reason, lps)], self.usage_of(out, o)))
            )
        return events

    def final(self, outs: list[RequestOutput], prompt_lens: list[int]) -> dict[str, Any]:
        choices = []
        top = self.shown.top
        for index, out in enumerate(outs):
            prompt_lps = self.prompt_logprobs_of(out) if self.shown.prompt else None
            for j, o in enumerate(out.outputs):  # best_of: the n best, best first
                text, ids = o.text, list(o.token_ids)
                entries = entries_of(o.logprobs, len(ids)) if top is not None else []
                if self.shown.echo:
                    text, ids, entries = self._with_echo(out, out.prompt_logprobs, text, ids, entries)
                lps = None
                if top is not None:
                    lps = completion_logprobs(ids, entries, self.texts.token, 0, self.shown.as_token_ids)[0]
                choice = self._choice(index * self.n + j, text, o.finish_reason, o.stop_reason, lps)
                if self.shown.prompt:
                    choice["prompt_logprobs"] = prompt_lps
                choices.append(choice)
        return self.chunk(choices, usage(sum(prompt_lens), completion_tokens(outs)))


def completion_tokens(outs: list[RequestOutput]) -> int:
    """usage.completion_tokens: the returned choices' tokens (vLLM's count; best_of's discarded
    samples are not in it, though /metrics' generation_tokens counts them)."""
    return sum(len(o.token_ids) for out in outs for o in out.outputs)


class ChatResponses(_Choices):
    """With a `tool_reader` (tool_parsers.py) each choice's text is read for tool calls: the final
    message gets `tool_calls` and the text outside them as `content`; a stream sends each
    reader delta (content, a call's head, argument fragments) as a chunk of its own. A choice
    that called a tool and stopped ends with the reader's finish_reason ("tool_calls")."""

    OBJECT = "chat.completion.chunk"

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        include_usage: bool = False,
        n: int = 1,
        shown: ShownLogprobs | None = None,
        texts: Texts | None = None,
        continuous_usage: bool = False,
        tool_reader: ToolCallReader | None = None,
    ):
        super().__init__(request_id, created, model, include_usage, n, shown, texts, continuous_usage)
        self.tool_reader = tool_reader
        self.tool_streams: dict[int, ToolCallStream] = {}  # choice index -> its reader
        if tool_reader is not None:
            self.simple = False

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        if called and reason == "stop" and self.tool_reader is not None:
            return self.tool_reader.finish_reason
        return reason

    def _template(self) -> tuple[str, str]:
        return sse_template(self.chunk([self._choice(0, {"content": _HOLE}, None)], self.chunk_usage))

    @staticmethod
    def _choice(
        index: int, delta: dict[str, Any], finish_reason: str | None, stop_reason: Any = None, logprobs: Any = None
    ) -> dict[str, Any]:
        return {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def opening(self) -> list[str]:
        """The role comes first, on a chunk of its own per choice."""
        return [
            sse(
                self.chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    self.chunk_usage,
                )
            )
            for i in range(self.n)
        ]

    def _logprobs(self, token_ids: list[int], logprobs: SampleLogprobs | None) -> dict[str, Any] | None:
        top = self.shown.top
        if top is None:
            return None
        entries = entries_of(logprobs, len(token_ids))
        return {"content": chat_logprobs(token_ids, entries, top, self.texts.token, self.shown.as_token_ids)}

    def events(self, index: int, out: RequestOutput) -> list[str]:
        if self.simple:
            o = out.outputs[0]
            if o.finish_reason is None:
                return [self.head + json.dumps(o.delta_text, ensure_ascii=False) + self.tail]
            delta = {"content": o.delta_text} if o.delta_text else {}
            return [sse(self.chunk([self._choice(0, delta, o.finish_reason, o.stop_reason)], self.chunk_usage))]
        events = []
        for i, _, o in self.changed(index, out):
            lps = self._logprobs(list(o.delta_token_ids), o.logprobs)
            if self.tool_reader is None:
                delta = {"content": o.delta_text} if o.delta_text or o.finish_reason is None else {}
                events.append(
                    sse(
                        self.chunk([self._choice(i, delta, o.finish_reason, o.stop_reason, lps)], self.usage_of(out, o))
                    )
                )
                continue
            events.extend(self._tool_events(i, o, lps, self.usage_of(out, o)))
        return events

    def _tool_events(self, i: int, o: CompletionOutput, lps: Any, chunk_usage: Any) -> list[str]:
        """One choice's new text through its tool-call reader: a chunk per reader delta, the
        logprobs on the first, the finish_reason on the last (an empty delta when it has none)."""
        assert self.tool_reader is not None
        reader = self.tool_streams.get(i)
        if reader is None:
            reader = self.tool_streams[i] = self.tool_reader.streamer()
        done = o.finish_reason is not None
        deltas = reader.feed(o.delta_text, done)
        finish = self._finish_reason(o.finish_reason, reader.called)
        if not deltas and (done or lps is not None):
            deltas = [{}]
        events = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            choice = self._choice(
                i, delta, finish if last else None, o.stop_reason if last else None, lps if k == 0 else None
            )
            events.append(sse(self.chunk([choice], chunk_usage)))
        return events

    def _message(self, o: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """A final choice's message and finish_reason."""
        if self.tool_reader is None:
            return {"role": "assistant", "content": o.text}, o.finish_reason
        content, calls = self.tool_reader.extract(o.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message, self._finish_reason(o.finish_reason, bool(calls))

    def final(self, outs: list[RequestOutput], prompt_lens: list[int]) -> dict[str, Any]:
        choices = []
        for j, o in enumerate(outs[0].outputs):
            message, finish_reason = self._message(o)
            choices.append(
                {
                    "index": j,
                    "message": message,
                    "logprobs": self._logprobs(list(o.token_ids), o.logprobs),
                    "finish_reason": finish_reason,
                    "stop_reason": o.stop_reason,
                }
            )
        answer = {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(prompt_lens[0], completion_tokens(outs)),
        }
        if self.shown.prompt:
            answer["prompt_logprobs"] = self.prompt_logprobs_of(outs[0])
        return answer
