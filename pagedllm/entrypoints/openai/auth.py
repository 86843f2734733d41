"""The API key: `Authorization: Bearer KEY` on /v1/* (health and metrics stay open)."""

from __future__ import annotations

import hmac
from typing import Any

from pagedllm.entrypoints.openai.errors import error_response


class AuthMiddleware:
    """ASGI middleware; the key is compared in constant time so its prefix cannot be probed."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
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
