"""OpenAI-compatible HTTP server (FastAPI + uvicorn) on top of AsyncLLM.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health,
GET /metrics. Request bodies are parsed by hand so that every client mistake (malformed JSON,
a wrong type, an unsupported option) is a 400 in OpenAI's error schema naming the field:
`{"error": {"message", "type", "param", "code"}}`. Nothing a client sends can reach the
engine unvalidated. The engine runs in its own process (AsyncLLM's engine core), so this
process only parses, tokenizes, detokenizes and streams; if the core dies, open streams end
with an error event and new requests get 503.

A request's life: parse -> SamplingParams -> tokenize and validate (raises before any byte is
sent) -> AsyncLLM.add_request -> stream SSE chunks, or wait for the final output. A client that
goes away aborts its request (the streaming body is cancelled; a non-streamed request has a
watcher on the connection), so its KV blocks are freed at the start of the next engine step.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.entrypoints.async_llm import AsyncLLM, EngineShutdownError, EngineStepError, QueueFullError, RequestStream

logger = logging.getLogger("pagedllm")

API_KEY_ENV = "PAGEDLLM_API_KEY"
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# ---- errors --------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(
    status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


_PARAM_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")


def _value_error(e: ValueError, prompt_param: str) -> APIError:
    """A ValueError from SamplingParams or the engine's validation -> 400 naming the field."""
    msg = str(e)
    if isinstance(e, InvalidRequestError) and e.param is not None:
        return bad_request(e.message, prompt_param if e.param == "prompt" else e.param, e.code)
    m = _PARAM_IN_MESSAGE.search(msg)
    if m:
        return bad_request(msg.replace("SamplingParams.", ""), m.group(1))
    if "max_model_len" in msg:
        return bad_request(msg, prompt_param, "context_length_exceeded")
    if "KV blocks" in msg:
        return bad_request(msg, "max_tokens", "context_length_exceeded")
    return bad_request(msg, prompt_param)


# ---- request parsing -----------------------------------------------------------------------
def _reject_constant(name: str):
    raise ValueError(f"{name} is not a valid JSON number")


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_json_type(body)}")
    return body


def _json_type(v: Any) -> str:
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


def _get(body: dict, name: str, kind: str, default: Any = None) -> Any:
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
        what = {
            "bool": "a boolean",
            "int": "an integer",
            "number": "a number",
            "str": "a string",
            "list": "an array",
            "dict": "an object",
        }[kind]
        raise bad_request(f"'{name}' must be {what}, got {_json_type(v)}", name)
    return v


def _refuse_unsupported(body: dict, chat: bool) -> None:
    n = _get(body, "n", "int", 1)
    if n != 1:
        raise bad_request(f"n={n} is not supported (only n=1); send several requests instead", "n")
    best_of = _get(body, "best_of", "int", 1)
    if best_of != 1:
        raise bad_request("best_of is not supported", "best_of")
    if chat:
        if _get(body, "logprobs", "bool", False):
            raise bad_request("logprobs is not supported", "logprobs")
        if body.get("top_logprobs") not in (None, 0):
            raise bad_request("top_logprobs is not supported", "top_logprobs")
        if body.get("tools") or body.get("functions"):
            raise bad_request("tool calling is not supported", "tools" if body.get("tools") else "functions")
        fmt = _get(body, "response_format", "dict")
        if fmt is not None and fmt.get("type", "text") != "text":
            raise bad_request("response_format other than text is not supported", "response_format")
    else:
        if body.get("logprobs") is not None:
            raise bad_request("logprobs is not supported", "logprobs")
        if _get(body, "echo", "bool", False):
            raise bad_request("echo is not supported", "echo")
        if _get(body, "suffix", "str"):
            raise bad_request("suffix is not supported", "suffix")
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, "number", 0) != 0:
            raise bad_request(f"{name} is not supported", name)
    if _get(body, "repetition_penalty", "number", 1) != 1:
        raise bad_request("repetition_penalty is not supported", "repetition_penalty")
    if _get(body, "logit_bias", "dict"):
        raise bad_request("logit_bias is not supported", "logit_bias")
    if _get(body, "use_beam_search", "bool", False):
        raise bad_request("beam search is not supported", "use_beam_search")


def _sampling_params(body: dict, chat: bool, default_max_tokens: int | None) -> SamplingParams:
    _refuse_unsupported(body, chat)
    max_tokens = _get(body, "max_completion_tokens", "int")
    max_name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_name = _get(body, "max_tokens", "int"), "max_tokens"
    if max_tokens is None:
        max_tokens = default_max_tokens
    kwargs: dict[str, Any] = {}
    for name, kind in (
        ("temperature", "number"),
        ("top_p", "number"),
        ("top_k", "int"),
        ("min_p", "number"),
        ("min_tokens", "int"),
        ("ignore_eos", "bool"),
        ("seed", "int"),
        ("stop_token_ids", "list"),
    ):
        v = _get(body, name, kind)
        if v is not None:
            kwargs[name] = v
    seed = kwargs.get("seed")
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise bad_request("'seed' must fit in a signed 64-bit integer", "seed")
    stop = body.get("stop")
    if stop is not None:
        if not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
            raise bad_request("'stop' must be a string or an array of strings", "stop")
        kwargs["stop"] = [stop] if isinstance(stop, str) else stop
        if not kwargs["stop"]:
            del kwargs["stop"]
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        err = _value_error(e, "prompt")
        if err.param == "max_tokens":
            err.param = max_name
        raise err from None


def _check_model(body: dict, served_model_name: str) -> None:
    model = _get(body, "model", "str")
    if model is not None and model != served_model_name:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{served_model_name}'",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _get(body, "stream", "bool", False)
    opts = _get(body, "stream_options", "dict")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        include_usage = _get(opts, "include_usage", "bool", False)
    return stream, include_usage


def _completion_prompts(body: dict) -> list[Any]:
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
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt
        ):
            return list(prompt)
    raise bad_request(
        "'prompt' must be a string, an array of strings, an array of token ids or an array of "
        "arrays of token ids (none of them empty)",
        "prompt",
    )


def _message_text(content: Any, i: int) -> str:
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


_RESERVED_TEMPLATE_KWARGS = {
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


def _chat_prompt(body: dict, tokenizer: Any, served_model_name: str) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of {role, content} objects", "messages")
    conversation = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", "messages")
        conversation.append({"role": m["role"], "content": _message_text(m.get("content"), i)})
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request(
            f"the model '{served_model_name}' has no chat template, so /v1/chat/completions cannot "
            "build a prompt; use /v1/completions",
            "messages",
            "no_chat_template",
        )
    extra = _get(body, "chat_template_kwargs", "dict", {})
    bad = sorted(set(extra) & _RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {bad}", "chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **extra)
    except Exception as e:  # jinja errors, raise_exception() in the template
        raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
    if not isinstance(text, str):
        raise bad_request("the chat template did not produce a string", "messages")
    return text


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
_HOLE = "\x00pagedllm-delta\x00"


def _sse_template(obj: Any) -> tuple[str, str]:
    """The SSE text of `obj` split around its one `_HOLE` string: a mid-stream chunk is then
    `head + json.dumps(delta) + tail`, without serializing the whole chunk for every token."""
    head, tail = _sse(obj).split(json.dumps(_HOLE, ensure_ascii=False))
    return head, tail


# ---- the app -------------------------------------------------------------------------------
class _AuthMiddleware:
    """Bearer-key check on /v1/* (health and metrics stay open), compared in constant time."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = b""
            for k, v in scope.get("headers", ()):
                if k == b"authorization":
                    given = v
                    break
            if not hmac.compare_digest(given, self.expected):
                response = error_response(
                    401,
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                    "authentication_error",
                    None,
                    "invalid_api_key",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Submitted:
    """One HTTP request's engine requests (one per prompt), with their prompt lengths."""

    def __init__(self, handles: list[RequestStream], prompt_lens: list[int]):
        self.handles = handles
        self.prompt_lens = prompt_lens

    def close(self) -> None:
        for h in self.handles:
            h.close()


def build_app(async_llm: AsyncLLM, served_model_name: str | None = None, api_key: str | None = None) -> FastAPI:
    """The ASGI app. It does not own async_llm (run_server shuts that down)."""
    from pagedllm.entrypoints.metrics import ServerMetrics

    if served_model_name is None:
        served_model_name = os.path.basename(os.path.normpath(async_llm.model_path))
    app = FastAPI(title="pagedllm", version=_version(), docs_url=None, redoc_url=None, openapi_url=None)
    app.state.async_llm = async_llm
    app.state.served_model_name = served_model_name
    metrics = ServerMetrics(async_llm, served_model_name)
    app.state.metrics = metrics
    tokenizer = async_llm.tokenizer
    created = int(time.time())
    kv_tokens = async_llm.num_kv_blocks * async_llm.block_size
    max_model_len = async_llm.max_model_len

    # -- error handlers: OpenAI's schema everywhere, never FastAPI's 422 --
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errs = e.errors()
        param = ".".join(str(x) for x in errs[0].get("loc", ())[1:]) if errs else None
        return error_response(
            400, f"invalid request: {errs[0].get('msg') if errs else e}", "invalid_request_error", param or None
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(e).__name__}", "internal_server_error")

    # -- helpers that close over the engine --
    def submit(prompts: list[Any], params: SamplingParams, base_id: str, stream: bool, prompt_param: str) -> _Submitted:
        """Tokenize, validate and queue every prompt, or none of them."""
        handles: list[RequestStream] = []
        lens: list[int] = []
        try:
            tokenized = []
            for p in prompts:
                text, ids = async_llm.tokenize(p)
                async_llm.validate_length(len(ids), params.max_tokens)
                tokenized.append(ids if text is None else {"prompt": text, "prompt_token_ids": ids})
                lens.append(len(ids))
            for i, p in enumerate(tokenized):
                rid = base_id if len(tokenized) == 1 else f"{base_id}-{i}"
                handles.append(async_llm.add_request(p, params, rid, stream=stream))
        except ValueError as e:
            for h in handles:
                h.close()
            raise _value_error(e, prompt_param) from None
        except QueueFullError as e:
            for h in handles:
                h.close()
            raise APIError(429, str(e), "rate_limit_error", None, "queue_full") from None
        except EngineShutdownError as e:
            for h in handles:
                h.close()
            raise APIError(
                503, str(e), "service_unavailable", None, "engine_dead" if async_llm.is_dead else "shutting_down"
            ) from None
        return _Submitted(handles, lens)

    async def finals(request: Request, sub: _Submitted) -> list[RequestOutput]:
        """Wait for every final output; a client that disconnects first aborts them."""

        async def last(h: RequestStream) -> RequestOutput:
            out = None
            async for out in h:  # noqa: B007  (the last one is the final output)
                pass
            return out

        async def disconnected() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        work = asyncio.ensure_future(asyncio.gather(*(last(h) for h in sub.handles)))
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                sub.close()
        if not work.done() or work.cancelled():
            raise APIError(499, "the client closed the connection", "invalid_request_error", None, "client_closed")
        try:
            outs = work.result()
        except EngineStepError as e:
            raise APIError(500, str(e), "internal_server_error") from None
        except EngineShutdownError as e:
            raise APIError(503, str(e), "service_unavailable", None, "engine_dead") from None
        if any(o.outputs[0].finish_reason == "abort" for o in outs):
            raise APIError(
                503, "the request was aborted (the server is shutting down)", "service_unavailable", None, "aborted"
            )
        return outs

    async def merged(sub: _Submitted) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(sub.handles) == 1:
            async for out in sub.handles[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, h: RequestStream) -> None:
            try:
                async for out in h:
                    queue.put_nowait((i, out))
            except BaseException as e:  # noqa: BLE001  (handed to the consumer)
                queue.put_nowait((i, e))

        tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(sub.handles)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def streaming(sub: _Submitted, make_chunks, usage_chunk, include_usage: bool) -> _SSEResponse:
        async def body() -> AsyncIterator[str]:
            completion_tokens = [0] * len(sub.handles)
            try:
                for first in make_chunks(None, None):
                    yield first
                async for i, out in merged(sub):
                    completion_tokens[i] = len(out.outputs[0].token_ids)
                    for chunk in make_chunks(i, out):
                        yield chunk
                if include_usage:
                    yield usage_chunk(_usage(sum(sub.prompt_lens), sum(completion_tokens)))
                yield SSE_DONE
            except EngineStepError as e:
                yield _sse(error_body(str(e), "internal_server_error"))
                yield SSE_DONE
            except EngineShutdownError as e:  # the engine core died mid-stream
                yield _sse(error_body(str(e), "service_unavailable", None, "engine_dead"))
                yield SSE_DONE
            finally:
                sub.close()

        return _SSEResponse(body(), sub.close)

    # -- routes --
    def model_card() -> dict:
        return {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "pagedllm",
            "root": async_llm.model_path,
            "parent": None,
            "max_model_len": max_model_len,
        }

    @app.get("/health")
    async def health():
        if not async_llm.is_running:
            return error_response(503, "the engine is not running", "service_unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        data, content_type = metrics.render()
        return Response(content=data, media_type=content_type)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        if model != served_model_name:
            raise APIError(
                404, f"The model '{model}' does not exist", "invalid_request_error", "model", "model_not_found"
            )
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json_body(request)
        _check_model(body, served_model_name)
        stream, include_usage = _stream_flags(body)
        params = _sampling_params(body, chat=False, default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS)
        prompts = _completion_prompts(body)
        rid = f"cmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        sub = submit(prompts, params, rid, stream, "prompt")

        chunk = _chunk_builder(rid, "text_completion", now, served_model_name)

        if stream:
            head, tail = _sse_template(
                chunk(
                    [{"index": 0, "text": _HOLE, "logprobs": None, "finish_reason": None, "stop_reason": None}],
                    None if include_usage else False,
                )
            )

            def make_chunks(i, out):
                if out is None:
                    return ()
                o = out.outputs[0]
                if i == 0 and o.finish_reason is None:
                    return (head + json.dumps(o.delta_text, ensure_ascii=False) + tail,)
                return (
                    _sse(
                        chunk(
                            [
                                {
                                    "index": i,
                                    "text": o.delta_text,
                                    "logprobs": None,
                                    "finish_reason": o.finish_reason,
                                    "stop_reason": o.stop_reason,
                                }
                            ],
                            None if include_usage else False,
                        )
                    ),
                )

            return streaming(sub, make_chunks, lambda u: _sse(chunk([], u)), include_usage)

        outs = await finals(request, sub)
        choices = [
            {
                "index": i,
                "text": o.outputs[0].text,
                "logprobs": None,
                "finish_reason": o.outputs[0].finish_reason,
                "stop_reason": o.outputs[0].stop_reason,
            }
            for i, o in enumerate(outs)
        ]
        return chunk(choices, _usage(sum(sub.prompt_lens), sum(len(o.outputs[0].token_ids) for o in outs)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json_body(request)
        _check_model(body, served_model_name)
        stream, include_usage = _stream_flags(body)
        text = _chat_prompt(body, tokenizer, served_model_name)
        try:
            _, ids = async_llm.tokenize(text)
        except ValueError as e:
            raise _value_error(e, "messages") from None
        # without max_tokens, OpenAI's default: whatever room is left in the context (and the KV cache)
        room = max(1, min(max_model_len, kv_tokens) - len(ids))
        params = _sampling_params(body, chat=True, default_max_tokens=room)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        sub = submit([{"prompt": text, "prompt_token_ids": ids}], params, rid, stream, "messages")

        chunk = _chunk_builder(rid, "chat.completion.chunk", now, served_model_name)

        if stream:
            u = None if include_usage else False
            head, tail = _sse_template(
                chunk(
                    [
                        {
                            "index": 0,
                            "delta": {"content": _HOLE},
                            "logprobs": None,
                            "finish_reason": None,
                            "stop_reason": None,
                        }
                    ],
                    u,
                )
            )

            def make_chunks(i, out):
                if out is None:  # the opening chunk carries the role
                    return (
                        _sse(
                            chunk(
                                [
                                    {
                                        "index": 0,
                                        "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None,
                                        "finish_reason": None,
                                    }
                                ],
                                u,
                            )
                        ),
                    )
                o = out.outputs[0]
                if o.finish_reason is None:
                    return (head + json.dumps(o.delta_text, ensure_ascii=False) + tail,)
                delta = {"content": o.delta_text} if (o.delta_text or o.finish_reason is None) else {}
                return (
                    _sse(
                        chunk(
                            [
                                {
                                    "index": 0,
                                    "delta": delta,
                                    "logprobs": None,
                                    "finish_reason": o.finish_reason,
                                    "stop_reason": o.stop_reason,
                                }
                            ],
                            u,
                        )
                    ),
                )

            return streaming(sub, make_chunks, lambda usage: _sse(chunk([], usage)), include_usage)

        out = (await finals(request, sub))[0]
        o = out.outputs[0]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": now,
            "model": served_model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": o.text},
                    "logprobs": None,
                    "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                }
            ],
            "usage": _usage(sub.prompt_lens[0], len(o.token_ids)),
        }

    if api_key:
        app.add_middleware(_AuthMiddleware, api_key=api_key)
    return app


def _chunk_builder(rid: str, obj: str, created: int, model: str) -> Callable[..., dict]:
    """chunk(choices, usage=False) -> one response object; usage False leaves the key out."""

    def chunk(choices: list, usage: Any = False) -> dict:
        c = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
        if usage is not False:
            c["usage"] = usage
        return c

    return chunk


class _SSEResponse(StreamingResponse):
    """Server-sent events whose `on_close` runs however the response ends. Starlette cancels
    the body when the client disconnects but leaves the generator suspended; closing the
    engine requests here makes the abort immediate instead of waiting for garbage collection."""

    def __init__(self, content: AsyncIterator[str], on_close):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _version() -> str:
    from pagedllm import __version__

    return __version__


# ---- running it ----------------------------------------------------------------------------
def _int_in(lo: int, hi: int | None, what: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return v

    parse.__name__ = what
    return parse


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    g.add_argument(
        "--port",
        type=_int_in(0, 65535, "a port number in [0, 65535]"),
        default=8000,
        help="TCP port (0 picks a free one)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1/*; unset: ${API_KEY_ENV}, else no key",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send; unset: --model as given, else the directory's name",
    )
    g.add_argument(
        "--max-queue-len",
        type=_int_in(0, None, "an integer >= 0"),
        default=None,
        help="answer 429 while this many requests are waiting; unset: no limit",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level of the server and the engine",
    )
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    g.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM, how long to wait for the aborted streams to close",
    )
    g.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine in its own process (--no-engine-process: on a thread of the server "
        "process, sharing its GIL; for debugging)",
    )
    return parser


def run_server(args: argparse.Namespace) -> int:
    """Load the model, serve until SIGTERM/SIGINT, then abort in-flight requests (each stream
    ends cleanly) and return 0."""
    import uvicorn

    try:
        from pagedllm.entrypoints.cli import engine_kwargs
    except ImportError:  # pragma: no cover  (cli.py ships alongside)

        def engine_kwargs(a):
            return {"model": a.model}

    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(asctime)s %(message)s", datefmt="%m-%d %H:%M:%S")
    logger.setLevel(level)
    kwargs = engine_kwargs(args)
    async_llm = AsyncLLM(
        max_queue_len=args.max_queue_len, engine_process=getattr(args, "engine_process", True), **kwargs
    )
    name = args.served_model_name or (
        getattr(args, "model", None) or os.path.basename(os.path.normpath(async_llm.model_path))
    )
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    app = build_app(async_llm, name, api_key)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=str(args.log_level).lower(),
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
        ws="none",
        lifespan="off",
        access_log=not getattr(args, "disable_uvicorn_access_log", False),
    )
    server = _make_server(config, async_llm)
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler installed
    # before it starts is what it restores, so the process exits 0 instead of dying by SIGTERM.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    logger.info(
        "Serving model %r on http://%s:%d/v1%s", name, args.host, args.port, " (API key required)" if api_key else ""
    )
    try:
        server.run()
    finally:
        async_llm.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _make_server(config, async_llm: AsyncLLM):
    """A uvicorn.Server whose exit signal also aborts every in-flight request, so open streams
    end (finish_reason "abort", then [DONE]) and graceful shutdown does not wait on them."""
    import uvicorn

    class Server(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None

        async def startup(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            if self.loop is not None:  # in a signal handler: hand over to the loop, take no lock here
                self.loop.call_soon_threadsafe(async_llm.begin_shutdown)
            else:
                async_llm.begin_shutdown()

    return Server(config)


def main(argv: list[str] | None = None) -> int:
    """`python -m pagedllm.entrypoints.server` = `pagedllm serve`."""
    import sys

    from pagedllm.entrypoints.cli import main as cli_main

    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
