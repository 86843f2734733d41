"""OpenAI's error schema and the exception handlers that answer in it.

Every refusal leaves the server as `{"error": {"message", "type", "param", "code"}}`, never as
FastAPI's 422. An `InvalidRequestError` (raised by SamplingParams and the InputProcessor) is
mapped by its attributes: `param` names the field, `code` is passed through. The only rewrite
is of the field's spelling, which depends on the endpoint (`prompt` on /v1/completions is
`messages` on chat; `max_tokens` is `max_completion_tokens` when the client used that name);
the message text is never read.

Nothing internal leaves in a body: an unexpected exception is answered with a generic 500 that
carries a request id, and its traceback is logged once, under that id (`InternalErrorMiddleware`;
Starlette's own last-resort handler would log it a second time through uvicorn). A client that
goes away while its body is being read is not an error of the server (one debug line).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pagedllm.engine.errors import InvalidRequestError

logger = logging.getLogger("pagedllm")


class APIError(Exception):
    """An HTTP answer in OpenAI's schema: status, message, type, and optionally param and code."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        r = error_response(self.status, self.message, self.type, self.param, self.code)
        r.headers.update(self.headers)
        return r


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(
    status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def new_error_id() -> str:
    """The id a 500 body and the server log share, so an operator can find the traceback."""
    return f"err-{uuid.uuid4().hex}"


def internal_error(request_id: str) -> APIError:
    """The only 500 a client sees: no exception type or text, just the id to quote."""
    return APIError(
        500,
        f"the server had an error while processing the request (request id {request_id}); "
        "the server log has the details",
        "internal_server_error",
    )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def invalid_request(
    e: InvalidRequestError, prompt_param: str = "prompt", max_tokens_param: str = "max_tokens"
) -> APIError:
    """400 from the engine's error: its param as this endpoint's client spells the field, its code as is."""
    renames = {"prompt": prompt_param, "max_tokens": max_tokens_param}
    e = e.renamed(renames.get(e.param, e.param) if e.param is not None else None)
    return bad_request(e.message, e.param, e.code)


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI's schema for every error the app can raise, including routing and framework errors."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid_request(request: Request, e: InvalidRequestError) -> JSONResponse:
        return invalid_request(e).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        param = ".".join(str(x) for x in errs[0].get("loc", ())[1:]) if errs else None
        return error_response(
            400, f"invalid request: {errs[0].get('msg') if errs else e}", "invalid_request_error", param or None
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, e: ClientDisconnect) -> Response:
        logger.debug("%s %s: the client disconnected before sending its whole body", request.method, request.url.path)
        return Response(status_code=400)  # nobody is there to read it


class InternalErrorMiddleware:
    """ASGI middleware (outside every other one of the app): an exception nobody handled is
    logged once with its traceback and a request id, and answered with `internal_error(id)`; a
    response already under way is cut off (uvicorn logs one line and closes the connection)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception:
            rid = new_error_id()
            logger.exception("unhandled error in %s %s (request id %s)", scope["method"], scope["path"], rid)
            if not started:
                await internal_error(rid).response()(scope, receive, send)
