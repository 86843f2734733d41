"""What a request must look like before any route sees it: its Host, its Content-Type, its size.

A browser lets any web page send a "simple" cross-origin POST without asking the server first
(no CORS preflight) when its Content-Type is text/plain, form-urlencoded or multipart; so
`BodyGuard` answers 415 to a POST that is not `application/json`, and such a page cannot make a
local server generate. DNS rebinding gets past that: a page on evil.example re-resolves its own
name to 127.0.0.1 and talks to the local server as same-origin, but its requests still say
`Host: evil.example`; so `HostGuard`, used when the server is bound to a loopback address,
answers 421 to a Host that is not a loopback name. 421 (Misdirected Request) rather than 400:
the request is well formed, it names an authority this server does not answer for.

Every refusal is in OpenAI's error schema. Limits are checked from the headers, and the body
size again while a chunked body is read, so a request over the limit is never held in memory.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

from pagedllm.entrypoints.openai.errors import APIError, error_response

DEFAULT_MAX_REQUEST_BODY_SIZE = 32 << 20  # bytes: a 6 MB prompt fits with room to spare

LOOPBACK_NAMES = frozenset({"localhost"})  # plus every loopback address literal: 127.0.0.0/8, ::1


def host_name(value: str) -> str:
    """A Host header's name without its port: `[::1]:8000` -> `::1`, `Example.com:80` -> `example.com`."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def is_loopback(name: str) -> bool:
    """A loopback name or address literal (what a DNS name under an attacker's control is not)."""
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _header(scope: Any, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return bytes(v)
    return None


class HostGuard:
    """ASGI middleware: the Host header must be a loopback name or address (any port) or one of
    `extra_hosts` (names, matched without port and case). A request without Host (HTTP/1.0) is
    let through: no browser sends one."""

    def __init__(self, app: Any, extra_hosts: Iterable[str] = ()):
        self.app = app
        self.extra = frozenset(host_name(h) for h in extra_hosts)

    def allowed(self, host: str) -> bool:
        name = host_name(host)
        return is_loopback(name) or name in self.extra

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            raw = _header(scope, b"host")
            host = raw.decode("latin-1") if raw is not None else None
            if host is not None and not self.allowed(host):
                response = error_response(
                    421,
                    f"Host {host[:200]!r} is not allowed: this server answers only requests for a loopback "
                    "name (localhost, 127.0.0.1, [::1]) or a name of --allowed-hosts (DNS-rebinding protection)",
                    "invalid_request_error",
                    None,
                    "invalid_host",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyGuard:
    """ASGI middleware: a POST must say `Content-Type: application/json` (parameters such as
    charset allowed), else 415; a body over `max_body_size` bytes gets 413, from its
    Content-Length before anything is read, or as soon as a chunked body passes the limit. A
    413 closes the connection (`Connection: close`), so the rest of the body is never read."""

    def __init__(self, app: Any, max_body_size: int = DEFAULT_MAX_REQUEST_BODY_SIZE):
        if max_body_size < 1:
            raise ValueError(f"max_body_size must be >= 1 byte, got {max_body_size}")
        self.app = app
        self.max_body_size = max_body_size

    def too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_body_size} bytes "
            "(--max-request-body-size)",
            "invalid_request_error",
            None,
            "request_too_large",
            headers={"Connection": "close"},
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "POST":
            raw = _header(scope, b"content-type")
            media = (raw or b"").split(b";", 1)[0].strip().lower()
            if media != b"application/json":
                shown = raw.decode("latin-1")[:100] if raw is not None else "none"
                response = error_response(
                    415,
                    f"the request body must be JSON sent with 'Content-Type: application/json', got {shown!r}",
                    "invalid_request_error",
                    None,
                    "unsupported_media_type",
                )
                await response(scope, receive, send)
                return
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body_size:
            await self.too_large().response()(scope, receive, send)
            return
        limit, seen = self.max_body_size, 0

        async def counted_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise self.too_large()  # answered by the app's APIError handler
            return message

        await self.app(scope, counted_receive, send)
