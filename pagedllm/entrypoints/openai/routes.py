"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) on top of AsyncLLM.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health,
GET /metrics, and vLLM's POST /tokenize, POST /detokenize (tokenize.py), GET /version. The engine runs in its own process (AsyncLLM's engine core), so this process only
parses, tokenizes, detokenizes and streams; if the core dies, open streams end with an error
event and new requests get 503 (`pagedllm serve` then exits, unless told to keep serving:
launcher.py).

Before a route runs, from the outside in: `InternalErrorMiddleware` (errors.py: a generic 500,
the traceback logged once), `HostGuard` (guards.py: when `allowed_hosts` is given),
`CORSMiddleware` (when `allowed_origins` is given: outside the key check, since a browser's
preflight carries no key), `AuthMiddleware` (when `api_key` is given), `BodyGuard` (guards.py:
JSON content type, body size). With the request timeline on (PAGEDLLM_TIMELINE), `ArrivalStamp`
sits just inside the first: when the request reached the app.

The package `pagedllm.entrypoints.openai`, one concept per module:

| module | holds |
| --- | --- |
| `routes.py` | `build_app`: the routes, a few lines each |
| `api_server.py` | `python -m pagedllm.entrypoints.openai.api_server`: the entry module under vLLM's name (launcher + routes) |
| `serving.py` | `OpenAIServing`: body -> answer, the async engine injected (no HTTP) |
| `parsing.py` | JSON body -> `ParsedRequest`: field types, unsupported options, model, stream flags |
| `chat.py` | chat messages -> prompt through the chat template |
| `tokenize.py` | /tokenize and /detokenize bodies -> answers |
| `responses.py` | completion and chat objects, SSE events, usage |
| `errors.py` | `APIError`, OpenAI's error schema, the exception handlers |
| `auth.py` | the Bearer-key middleware |
| `guards.py` | Host, Content-Type and body-size checks (cross-origin and DNS-rebinding defences) |
| `connections.py` | uvicorn's HTTP protocol (httptools, else h11) with a deadline for each request head (idle sockets) |
| `metrics.py` | Prometheus metrics (`/metrics`) |
| `launcher.py` | `add_server_args`, `run_server`: flags, uvicorn, signals, shutdown |
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse

from pagedllm.entrypoints.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.auth import AuthMiddleware
from pagedllm.entrypoints.openai.errors import InternalErrorMiddleware, error_response, install_error_handlers
from pagedllm.entrypoints.openai.guards import DEFAULT_MAX_REQUEST_BODY_SIZE, BodyGuard, HostGuard
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.parsing import json_body
from pagedllm.entrypoints.openai.serving import OpenAIServing, SSEStream
from pagedllm.entrypoints.openai.tokenize import detokenize_body, tokenize_body


class SSEResponse(StreamingResponse):
    """Server-sent events whose `on_close` runs however the response ends. Starlette cancels
    the body when the client disconnects but leaves the generator suspended; closing the
    engine requests here makes the abort immediate instead of waiting for garbage collection."""

    def __init__(self, stream: SSEStream):
        super().__init__(
            stream.events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = stream.close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _answer(result: dict[str, Any] | SSEStream) -> Any:
    return SSEResponse(result) if isinstance(result, SSEStream) else result


ARRIVED = "pagedllm.arrived"  # the scope key of ArrivalStamp's time


class ArrivalStamp:
    """ASGI middleware, only while the request timeline is on (PAGEDLLM_TIMELINE): the time a
    request reached the app (uvicorn has parsed its head), so the timeline can split the client's
    send -> the route handler into the time before the app and the middlewares plus the body read."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        scope[ARRIVED] = time.monotonic()
        await self.app(scope, receive, send)


def _arrived(request: Request) -> float | None:
    return request.scope.get(ARRIVED)


def _watcher(request: Request) -> Any:
    """The `disconnected` callback of a non-streamed request: returns when the client has gone."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return disconnected


def build_app(
    async_llm: AsyncLLM,
    served_model_name: str | Sequence[str] | None = None,
    api_key: str | None = None,
    *,
    allowed_hosts: Iterable[str] | None = None,
    max_request_body_size: int = DEFAULT_MAX_REQUEST_BODY_SIZE,
    allowed_origins: Sequence[str] | None = None,
    allowed_methods: Sequence[str] = ("*",),
    allowed_headers: Sequence[str] = ("*",),
    allow_credentials: bool = False,
    tool_parser: str | None = None,
    trust_request_chat_template: bool = False,
) -> FastAPI:
    """The ASGI app. It does not own async_llm (run_server shuts that down). `allowed_hosts`:
    None accepts any Host header; otherwise the Host must be a loopback name or address or one
    of these names (run_server passes () when bound to loopback). `max_request_body_size`: bytes.
    `allowed_origins` (None: no CORS headers at all) and the other three: CORS, as vLLM's flags.
    `tool_parser`: the parser of tool_choice "auto" (None: "auto" tool choice is off);
    `trust_request_chat_template`: a request may bring its own chat_template."""
    from pagedllm import __version__

    if served_model_name is None:
        served_model_name = os.path.basename(os.path.normpath(str(async_llm.model_path)))
    app = FastAPI(title="pagedllm", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    serving = OpenAIServing(
        async_llm, served_model_name, tool_parser=tool_parser, trust_request_chat_template=trust_request_chat_template
    )
    names = serving.served_model_names
    metrics = ServerMetrics(async_llm, serving.served_model_name)
    app.state.async_llm, app.state.served_model_name = async_llm, serving.served_model_name
    app.state.serving, app.state.metrics = serving, metrics
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if not async_llm.is_running:
            return error_response(503, "the engine is not running", "service_unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        data, content_type = metrics.render()
        return Response(content=data, media_type=content_type)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        raw = await request.body()
        return await asyncio.to_thread(lambda: tokenize_body(json_body(raw), async_llm, names, serving.special_texts))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        raw = await request.body()
        return await asyncio.to_thread(lambda: detokenize_body(json_body(raw), async_llm, names))

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": serving.model_cards()}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        return serving.get_model(model)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return _answer(await serving.create_completion(await request.body(), _watcher(request), _arrived(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return _answer(await serving.create_chat_completion(await request.body(), _watcher(request), _arrived(request)))

    # add_middleware puts each one outside the ones before it
    app.add_middleware(BodyGuard, max_body_size=max_request_body_size)
    if api_key:
        app.add_middleware(AuthMiddleware, api_key=api_key)
    if allowed_origins is not None:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=list(allowed_methods),
            allow_headers=list(allowed_headers),
            allow_credentials=allow_credentials,
        )
    if allowed_hosts is not None:
        app.add_middleware(HostGuard, extra_hosts=tuple(allowed_hosts))
    if async_llm.timeline is not None:
        app.add_middleware(ArrivalStamp)
    app.add_middleware(InternalErrorMiddleware)
    return app
