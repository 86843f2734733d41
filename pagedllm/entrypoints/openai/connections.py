"""uvicorn's h11 connection protocol with a deadline for every request head.

uvicorn closes a kept-alive connection that stays silent for `timeout_keep_alive` seconds after
a response, but it arms that timer only after a response and disarms it on any byte: a client
that opens a socket and sends nothing, or sends a request head a byte at a time, holds its
connection (a file descriptor and a protocol object) forever, and a few thousand of them exhaust
the server's descriptors. Here the same timeout also runs from the moment a connection opens
and after every response, and only a complete request head (h11's Request event) stops it;
bytes that trickle in do not. A request that is being served (a long stream) has no deadline.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadTimeoutH11Protocol(H11Protocol):
    """`config.timeout_keep_alive` seconds to send each request head, from the connection's
    opening or the previous response's end; then the connection is closed."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request head arrived
            self._stop_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next pipelined request at once
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
        if self.transport.is_closing() or not self._between_requests():
            return
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass
        self.transport.close()
