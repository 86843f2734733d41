"""The serving logic of /v1/completions and /v1/chat/completions, without HTTP.

`OpenAIServing(async_llm, served_model_name)` takes a JSON body (its raw bytes, as the HTTP
route passes it, or the parsed dict) and returns the answer:
a dict (the JSON object of a non-streamed request) or an `SSEStream`; every refusal is an
`APIError`. The engine is injected, so a test can drive this class with a thread-mode AsyncLLM
and no server (tests/server/test_serving.py).

A request's life, validated once at the edge: body -> ParsedRequest (`parsing.py`, JSON shapes)
-> one SamplingParams (`sampling_params_with_defaults`: the fields the client set win, the
model's generation_config.json fills the rest) -> `input_processor.process` for every prompt
(tokenize and every admission check; all prompts of a request are checked before any is
queued) -> `add_request(EngineCoreRequest)` -> the final outputs or a stream of SSE events (answers.py).
Everything before `add_request` (JSON decoding when the body comes as bytes, the chat template,
tokenizing, the checks) runs on a worker thread of the loop's default executor (`asyncio.to_thread`,
a bounded pool) when it may take long: a 6 MB prompt takes seconds to tokenize, and on the event
loop it would stall every other client, /health included. A small body (`prepared_on_loop`: at
most INLINE_BODY_BYTES, no grammar, tools, template or bad words) is prepared on the loop: the
thread's two wake-ups cost more than a 512-token prompt's preparation, and a worker that has
tokenized must win the GIL back from a busy loop (up to sys.getswitchinterval(), 5 ms) before the
request moves on.
`add_request` and everything after it stay on the loop that owns the engine's streams.
A client that goes away aborts its requests: a stream through `SSEStream.close`, a
non-streamed request through the `disconnected` watcher.

Parallel sampling and logprobs: one engine request per prompt samples `n` (or `best_of`)
sequences; its RequestOutputs carry them all, and the builder (responses.py) numbers prompt i's
choices i * n .. i * n + n - 1. `usage.prompt_tokens` counts each prompt once,
`completion_tokens` the returned choices' tokens (best_of's discarded samples are not in it).

Beam search (`use_beam_search`, `n` beams): the same path, non-streamed only; the engine sends
one final RequestOutput whose outputs are the n beams, best first, so they become choices
i * n .. i * n + n - 1 like samples. Its SamplingParams take the client's fields only (greedy,
temperature 0 unless the client sent one): the model's sampling defaults are not applied, its
max_new_tokens still is (as for any request).

max_tokens when the client sets none: the model's `max_new_tokens` when its generation_config
sets one, else 16 (SamplingParams' default, OpenAI's for completions); chat: the room left in
the context and the KV cache, capped by the model's `max_new_tokens` when set.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.grammar import GrammarCompileError
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.engine.sampling_params import SamplingParams, sampling_params_with_defaults
from pagedllm.engine.timeline import Timeline
from pagedllm.entrypoints.async_llm import EngineShutdownError, QueueFullError
from pagedllm.entrypoints.chat_utils import SpecialTexts
from pagedllm.entrypoints.openai.answers import Disconnected, OutputStream, SSEStream, Submitted, events, finals
from pagedllm.entrypoints.openai.chat import parse_chat
from pagedllm.entrypoints.openai.errors import APIError, invalid_request
from pagedllm.entrypoints.openai.fields import UnknownFields
from pagedllm.entrypoints.openai.parsing import ParsedRequest, json_body, parse_completion, request_options
from pagedllm.entrypoints.openai.responses import (
    ChatResponses,
    CompletionResponses,
    ResponseBuilder,
    Texts,
)
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCallReader

logger = logging.getLogger("pagedllm")

# A body this small is prepared on the event loop (measured on the 2-core CPU box,
# benchmarks/request_prep.py: a 512-token prompt's preparation 0.19 ms as ids, 0.7 ms as text,
# against 0.25-0.3 ms for the hop to a worker thread and back in the running server)...
INLINE_BODY_BYTES = 8 << 10
# ...unless it names a field whose work does not scale with its size: a grammar to compile (the
# structured-output fields, tools), a chat template of its own, bad words (two encodes a word: a
# few KiB of short words is thousands of them). A match inside a prompt's text only sends that
# body to the thread.
THREAD_FIELDS = (
    b'"response_format"',
    b'"structured_outputs"',
    b'"guided_',
    b'"tools"',
    b'"tool_choice"',
    b'"chat_template"',
    b'"bad_words"',
)

T = TypeVar("T")


def prepared_on_loop(body: dict[str, Any] | bytes) -> bool:
    """Whether a request body is prepared on the event loop rather than on a worker thread."""
    return isinstance(body, bytes) and len(body) <= INLINE_BODY_BYTES and not any(f in body for f in THREAD_FIELDS)


class EngineClient(Protocol):
    """What the serving layer uses of AsyncLLM. The server hands `add_request` a checked
    EngineCoreRequest (which carries its params and id) and gets QueueFullError or
    EngineShutdownError when it cannot be queued."""

    generation_defaults: dict[str, Any]
    input_processor: InputProcessor
    tokenizer: Any
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    timeline: Timeline | None  # PAGEDLLM_TIMELINE: the API process's request timeline (engine/timeline.py)

    @property
    def model_path(self) -> Any: ...

    @property
    def is_dead(self) -> bool: ...

    def add_request(
        self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None, *, stream: bool = True
    ) -> OutputStream: ...


class OpenAIServing:
    """It does not own `async_llm` (whoever made it shuts it down)."""

    def __init__(
        self,
        async_llm: EngineClient,
        served_model_name: str | Sequence[str],
        *,
        tool_parser: str | None = None,
        trust_request_chat_template: bool = False,
    ):
        """`tool_parser`: the parser of tool_choice "auto" (`--enable-auto-tool-choice
        --tool-call-parser NAME`; None refuses "auto"). `trust_request_chat_template`: a request
        may bring its own `chat_template` (vLLM's `--trust-request-chat-template`)."""
        if tool_parser is not None and tool_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call parser {tool_parser!r}; known: {', '.join(TOOL_PARSERS)}")
        self.tool_parser, self.trust_request_chat_template = tool_parser, trust_request_chat_template
        self.engine = async_llm
        # every name the server answers to (`--served-model-name a b`); the first is the one /v1/models lists first
        self.served_model_names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
        assert self.served_model_names, "a server serves at least one name"
        self.served_model_name = self.served_model_names[0]
        self.created = int(time.time())
        self.kv_tokens = async_llm.num_kv_blocks * async_llm.block_size
        self.texts = Texts(async_llm.tokenizer)
        self.known_fields = UnknownFields()  # refuses the refused fields, warns once per unknown one
        # made here, before any request (chat_utils.SpecialTexts: no request writes the tokenizer's
        # split flag); None where no chat can be rendered
        tok = async_llm.tokenizer
        chats = tok is not None and (getattr(tok, "chat_template", None) or trust_request_chat_template)
        self.special_texts = SpecialTexts.of(tok) if chats else None

    # ---- /v1/models ----------------------------------------------------------------------
    def model_card(self, name: str | None = None) -> dict[str, Any]:
        name = name or self.served_model_name
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedllm",
            "root": self.served_model_name,  # never the model's directory: clients need no path of this host
            "parent": None,
            "max_model_len": self.engine.max_model_len,
        }

    def model_cards(self) -> list[dict[str, Any]]:
        return [self.model_card(n) for n in self.served_model_names]

    def get_model(self, model: str) -> dict[str, Any]:
        if model not in self.served_model_names:
            raise APIError(
                404, f"The model '{model}' does not exist", "invalid_request_error", "model", "model_not_found"
            )
        return self.model_card(model)

    # ---- /v1/completions and /v1/chat/completions ----------------------------------------
    async def create_completion(
        self, body: dict[str, Any] | bytes, disconnected: Disconnected | None = None, arrived: float | None = None
    ) -> dict[str, Any] | SSEStream:
        t_http = time.monotonic()
        parsed, requests, rid = await self._prepared(self._prepare_completion, body)
        self._note_arrival(rid, t_http, arrived)
        sub = self._submit(parsed, requests)
        builder = CompletionResponses(
            rid,
            int(time.time()),
            parsed.model,
            parsed.include_usage,
            parsed.n,
            parsed.shown,
            self.texts,
            continuous_usage=parsed.continuous_usage,
        )
        return await self._answer(parsed, sub, builder, rid, disconnected)

    async def create_chat_completion(
        self, body: dict[str, Any] | bytes, disconnected: Disconnected | None = None, arrived: float | None = None
    ) -> dict[str, Any] | SSEStream:
        t_http = time.monotonic()
        parsed, requests, rid, reader = await self._prepared(self._prepare_chat, body)
        self._note_arrival(rid, t_http, arrived)
        sub = self._submit(parsed, requests)
        builder = ChatResponses(
            rid,
            int(time.time()),
            parsed.model,
            parsed.include_usage,
            parsed.n,
            parsed.shown,
            self.texts,
            continuous_usage=parsed.continuous_usage,
            tool_reader=reader,
        )
        return await self._answer(parsed, sub, builder, rid, disconnected)

    @staticmethod
    async def _prepared(prepare: Callable[[dict[str, Any] | bytes], T], body: dict[str, Any] | bytes) -> T:
        """prepare(body) on the loop when the body is small and simple, else on a worker thread."""
        if prepared_on_loop(body):
            return prepare(body)
        return await asyncio.to_thread(prepare, body)

    def _note_arrival(self, rid: str, t_http: float, arrived: float | None) -> None:
        """Timeline: the request reached the app at `arrived` (routes.ArrivalStamp) and its body the
        handler at t_http; parsed and tokenized now."""
        timeline = self.engine.timeline
        if timeline is not None:
            if arrived is not None:
                timeline.event("asgi", arrived, user=rid)
            timeline.event("http", t_http, user=rid)
            timeline.event("prepared", user=rid)

    # ---- on a worker thread: JSON, the chat template, tokenizing, every check ----------------
    def _prepare_completion(self, body: dict[str, Any] | bytes) -> tuple[ParsedRequest, list[EngineCoreRequest], str]:
        body = json_body(body) if isinstance(body, bytes) else body
        self.known_fields.check(body, "completions")
        parsed = parse_completion(body, self.served_model_names)
        rid = f"cmpl-{parsed.request_id or uuid.uuid4().hex}"
        # asked for: past the context it is refused, never clamped; not asked for: the default
        # (the model's max_new_tokens, else 16) shrinks to the room left
        shared = self.sampling_params(parsed) if "max_tokens" in parsed.fields else None
        prompts = []
        for p in parsed.prompts:
            text, ids = self._tokenized(parsed, p)
            params = shared or self.sampling_params(parsed, cap=self._room(ids))
            prompts.append(({"prompt": text, "prompt_token_ids": ids}, params))
        return parsed, self._process(parsed, prompts, rid), rid

    def _prepare_chat(
        self, body: dict[str, Any] | bytes
    ) -> tuple[ParsedRequest, list[EngineCoreRequest], str, ToolCallReader | None]:
        body = json_body(body) if isinstance(body, bytes) else body
        self.known_fields.check(body, "chat")
        chat = parse_chat(
            body,
            self.served_model_names,
            self.engine.tokenizer,
            tool_parser=self.tool_parser,
            trust_request_chat_template=self.trust_request_chat_template,
            specials=self.special_texts,
        )
        parsed = request_options(chat.parsed, body, chat=True)
        rid = f"chatcmpl-{parsed.request_id or uuid.uuid4().hex}"
        prompt = parsed.prompts[0]  # {"prompt", "prompt_token_ids"}: chat.py tokenized it; process() checks the ids
        text, ids = self._tokenized(parsed, prompt)
        params = self.sampling_params(parsed, room=self._room(ids))
        return (
            parsed,
            self._process(parsed, [({"prompt": text, "prompt_token_ids": ids}, params)], rid),
            rid,
            chat.tool_reader,
        )

    def _tokenized(self, parsed: ParsedRequest, prompt: Any) -> tuple[str | None, list[int]]:
        """A prompt's (text, ids) as the engine will see them: the tokenizer's special tokens
        added when the request asks (text prompts only, as vLLM), then truncate_prompt_tokens
        applied (the text is dropped when it no longer matches the ids)."""
        ip = self.engine.input_processor
        try:
            if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
                text, ids = ip.tokenize(prompt)
                if parsed.add_special_tokens and text is not None:
                    ids = ip.with_special_tokens(ids)
            else:
                text, ids = ip.tokenize(prompt, add_special_tokens=parsed.add_special_tokens)
            return ip.truncate(text, ids, parsed.fields.get("truncate_prompt_tokens"))
        except InvalidRequestError as e:
            raise self._invalid(parsed, e) from None

    @staticmethod
    def _invalid(parsed: ParsedRequest, e: InvalidRequestError) -> APIError:
        """The engine's error as a 400 naming the field as this request's client spelled it."""
        if e.param == "structured_outputs":
            e = e.renamed(parsed.structured_param)
        return invalid_request(e, parsed.prompt_param, parsed.max_tokens_param)

    def _room(self, ids: list[int]) -> int:
        """Tokens a prompt leaves for its completion (at least 1: a too-long prompt is refused later)."""
        return max(1, min(self.engine.max_model_len, self.kv_tokens) - len(ids))

    def sampling_params(self, parsed: ParsedRequest, room: int | None = None, cap: int | None = None) -> SamplingParams:
        """The request's one SamplingParams. When the client sets no max_tokens: `room` (chat) is
        the default, capped by the model's own max_new_tokens; `cap` (completions) caps the usual
        default (the model's max_new_tokens, else 16), as vLLM does."""
        defaults = self.engine.generation_defaults
        fields = dict(parsed.fields)
        if room is not None and "max_tokens" not in fields:
            model_max = defaults.get("max_tokens")
            fields["max_tokens"] = room if model_max is None else min(room, model_max)
        if cap is not None and "max_tokens" not in fields:
            fields["max_tokens"] = min(cap, defaults.get("max_tokens", SamplingParams.max_tokens))
        if fields.get("use_beam_search"):
            # beam search is greedy and exact: the model's sampling defaults (a temperature, a
            # top_p) would make it refuse, so only the client's fields apply
            fields.setdefault("temperature", 0.0)
            defaults = {}
        try:
            return sampling_params_with_defaults(defaults, **fields)
        except InvalidRequestError as e:
            raise self._invalid(parsed, e) from None

    def _process(
        self, parsed: ParsedRequest, prompts: list[tuple[Any, SamplingParams]], base_id: str
    ) -> list[EngineCoreRequest]:
        """Every prompt checked by the input processor before any is queued."""
        try:
            return [
                self.engine.input_processor.process(base_id if len(prompts) == 1 else f"{base_id}-{i}", p, params)
                for i, (p, params) in enumerate(prompts)
            ]
        except InvalidRequestError as e:
            raise self._invalid(parsed, e) from None
        except GrammarCompileError as e:  # structured output cannot run here: the server's fault, said plainly
            raise APIError(
                500, str(e), "internal_server_error", "structured_outputs", "structured_output_unavailable"
            ) from None

    def _submit(self, parsed: ParsedRequest, requests: list[EngineCoreRequest]) -> Submitted:
        """Queue every request, or none of them."""
        sub = Submitted([], [len(r.prompt_token_ids) for r in requests])
        try:
            for r in requests:
                sub.streams.append(self.engine.add_request(r, stream=parsed.stream))
        except InvalidRequestError as e:
            sub.close()
            raise self._invalid(parsed, e) from None
        except QueueFullError as e:
            sub.close()
            raise APIError(429, str(e), "rate_limit_error", None, "queue_full") from None
        except EngineShutdownError as e:
            sub.close()
            code = "engine_dead" if self.engine.is_dead else "shutting_down"
            raise APIError(503, str(e), "service_unavailable", None, code) from None
        except BaseException:
            sub.close()
            raise
        return sub

    async def _answer(
        self,
        parsed: ParsedRequest,
        sub: Submitted,
        builder: ResponseBuilder,
        rid: str,
        disconnected: Disconnected | None,
    ) -> dict[str, Any] | SSEStream:
        if parsed.stream:
            return SSEStream(events(sub, builder, rid, parsed.include_usage, self.engine.timeline), sub.close)
        return builder.final(await finals(sub, rid, disconnected), sub.prompt_lens)
