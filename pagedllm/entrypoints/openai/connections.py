"""uvicorn's HTTP connection protocol with a deadline for every request head.

uvicorn closes a kept-alive connection that stays silent for `timeout_keep_alive` seconds after
a response, but it arms that timer only after a response and disarms it on any byte: a client
that opens a socket and sends nothing, or sends a request head a byte at a time, holds its
connection (a file descriptor and a protocol object) forever, and a few thousand of them exhaust
the server's descriptors. Here the same timeout also runs from the moment a connection opens
and after every response, and only a complete request head (a new request cycle) stops it;
bytes that trickle in do not. A request that is being served (a long stream) has no deadline.

The protocol is the one uvicorn's `http="auto"` picks (httptools when installed, else h11), with
`HeadDeadline` mixed in: it uses only what both have (`cycle`, `transport`, `loop`,
`timeout_keep_alive` and the asyncio.Protocol callbacks).
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any


class HeadDeadline:
    """Mixed in before a uvicorn HTTP protocol class: `timeout_keep_alive` seconds to send each
    request head, from the connection's opening or the previous response's end."""

    cycle: Any
    transport: Any
    loop: asyncio.AbstractEventLoop
    timeout_keep_alive: Any  # seconds (uvicorn types it int; a float works)
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not cycle:  # a request head arrived
            self._stop_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]  # may start a pipelined request at once
        if self._between_requests() and not self.transport.is_closing():
            self._await_head()

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _await_head(self) -> None:
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing() and self._between_requests():
            self.transport.close()  # connection_lost() settles the protocol's own state


def head_deadline_protocol(http: str = "auto") -> type[asyncio.Protocol]:
    """The protocol class for uvicorn.Config(http=...), with HeadDeadline: uvicorn's choice for
    "auto" (httptools when installed, else h11), or "h11"."""
    if http != "h11" and importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        class HttpToolsWithHeadDeadline(HeadDeadline, HttpToolsProtocol):
            pass

        return HttpToolsWithHeadDeadline
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class H11WithHeadDeadline(HeadDeadline, H11Protocol):
        pass

    return H11WithHeadDeadline
