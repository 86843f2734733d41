"""One API process's HTTP side: the listening sockets, uvicorn, the signals, the shutdown.

`serve(args, sockets, async_llm, ...)` runs the app of routes.py on bound sockets until SIGTERM or
SIGINT, then aborts the requests in flight (each stream ends cleanly) and returns 0; if the engine
core dies it stops and raises CLIError (unless --keep-alive-on-engine-death). `pagedllm serve` runs
it in its own process (launcher.py) or in each of N API processes (api_processes.py).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import socket
from typing import Any

import uvicorn

from pagedllm import envs
from pagedllm.entrypoints.args import CLIError
from pagedllm.entrypoints.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.connections import head_deadline_protocol
from pagedllm.entrypoints.openai.guards import is_loopback
from pagedllm.entrypoints.openai.routes import build_app

logger = logging.getLogger("pagedllm")


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound, not yet listening, sockets for host:port (every address the name resolves to, as
    asyncio binds them). CLIError when the port is taken or the address cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CLIError(f"cannot bind to host {host!r}: {e.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not blocked by TIME_WAIT
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            port = sock.getsockname()[1]  # port 0: every address gets the first one's port
    except OSError as e:
        for sock in sockets:
            sock.close()
        if e.errno == errno.EADDRINUSE:
            raise CLIError(f"port {port} on {host} is already in use (pick another with --port)") from None
        raise CLIError(f"cannot bind to {host} port {port}: {e.strerror or e}") from None
    return sockets


def is_loopback_bind(sockets: list[socket.socket]) -> bool:
    return all(is_loopback(s.getsockname()[0]) for s in sockets)


def allowed_hosts(flag: str | None, sockets: list[socket.socket]) -> list[str] | None:
    """build_app's allowed_hosts from --allowed-hosts: None (any Host) or the extra names."""
    if flag is None:
        return [] if is_loopback_bind(sockets) else None
    names = [n.strip() for n in flag.split(",") if n.strip()]
    return None if "*" in names else names


def uvicorn_config(app: Any, http: str = "auto", **kwargs: Any) -> uvicorn.Config:
    """uvicorn's Config as the server runs it: uvicorn's HTTP protocol with a deadline for each
    request head (connections.py), keep-alive $PAGEDLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds, no websockets, no
    lifespan. `http`: "auto" (httptools when installed) or "h11"; `kwargs` go to uvicorn.Config."""
    kwargs = {"timeout_keep_alive": envs.http_timeout_keep_alive(), **kwargs}
    return uvicorn.Config(app, http=head_deadline_protocol(http), ws="none", lifespan="off", **kwargs)


def bind_socket_groups(host: str, port: int, count: int) -> list[list[socket.socket]]:
    """`count` groups of bound sockets on the same addresses and port, each with SO_REUSEPORT, so
    that each API process listens on its own and the kernel spreads new connections over them.
    The port is checked free first without SO_REUSEPORT (a server already there, even one with
    SO_REUSEPORT of its own, is a CLIError, never a port shared with it). Without SO_REUSEPORT
    (not Linux or BSD) every group is the same sockets, shared by the processes."""
    probe = bind_sockets(host, port)
    addrs = [(s.family, s.getsockname()) for s in probe]
    if not hasattr(socket, "SO_REUSEPORT"):
        return [probe] * count
    for sock in probe:
        sock.close()
    groups: list[list[socket.socket]] = []
    try:
        for _ in range(count):
            group: list[socket.socket] = []
            groups.append(group)
            for family, addr in addrs:
                sock = socket.socket(family, socket.SOCK_STREAM)
                group.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
    except OSError as e:
        for group in groups:
            for sock in group:
                sock.close()
        if e.errno == errno.EADDRINUSE:
            raise CLIError(
                f"port {addrs[0][1][1]} on {host} was taken while binding it (pick another with --port)"
            ) from None
        raise CLIError(f"cannot bind to {host} port {addrs[0][1][1]}: {e.strerror or e}") from None
    return groups


def served_names(args: argparse.Namespace, model_path: str | None) -> list[str]:
    """--served-model-name, else the model as given, else the model directory's name."""
    return args.served_model_name or [args.model or os.path.basename(os.path.normpath(str(model_path)))]


def announce(sockets: list[socket.socket], names: list[str], api_key: str | None, count: int = 1) -> None:
    host, port = sockets[0].getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    logger.info(
        "Serving model %s on http://%s:%d/v1%s%s",
        ", ".join(repr(n) for n in names),
        shown,
        port,
        " (API key required)" if api_key else "",
        f" with {count} API processes" if count > 1 else "",
    )


def serve(
    args: argparse.Namespace,
    sockets: list[socket.socket],
    async_llm: AsyncLLM,
    template: str | None,
    tool_parser: str | None,
    keep_alive: bool,
    announce_it: bool = True,
) -> int:
    """Serve on `sockets` (bound) until SIGTERM/SIGINT; returns 0. Closes the sockets and shuts
    `async_llm` down in every case. CLIError when listening fails, and when the engine died
    (unless `keep_alive`)."""
    if template is not None:
        if async_llm.tokenizer is None:
            async_llm.shutdown()
            raise CLIError("--chat-template: the model has no tokenizer, so it cannot serve chat")
        async_llm.tokenizer.chat_template = template
    names = served_names(args, async_llm.model_path)
    api_key = args.api_key or envs.api_key()
    app = build_app(
        async_llm,
        names,
        api_key,
        allowed_hosts=allowed_hosts(args.allowed_hosts, sockets),
        max_request_body_size=args.max_request_body_size,
        allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
        tool_parser=tool_parser,
        trust_request_chat_template=args.trust_request_chat_template,
    )
    config = uvicorn_config(
        app,
        log_level=str(args.log_level).lower(),
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
        access_log=not args.disable_uvicorn_access_log,
    )
    server = AbortingServer(config, async_llm, exit_on_engine_death=not keep_alive)
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler installed
    # before it starts is what it restores, so the process exits 0 instead of dying by SIGTERM.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    if announce_it:
        announce(sockets, names, api_key)
    port = sockets[0].getsockname()[1]
    try:
        try:
            server.run(sockets=sockets)
        except OSError as e:  # listen() failed: the port was taken while the model loaded
            raise CLIError(f"cannot listen on {args.host} port {port}: {e.strerror or e}") from None
    finally:
        for sock in sockets:
            sock.close()
        async_llm.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if server.engine_died:
        raise CLIError(
            f"{async_llm.dead_reason or 'the engine core died'}: the server has stopped so that it can be "
            "restarted (--keep-alive-on-engine-death keeps it serving 503s instead)"
        )
    return 0


class AbortingServer(uvicorn.Server):
    """A uvicorn.Server whose exit signal also aborts every in-flight request, so open streams
    end and graceful shutdown does not wait on them. With `exit_on_engine_death` it also stops
    (and sets `engine_died`) once the engine core has died: the open streams have had their
    error event by then, the output handler fails them the moment the core's pipe closes."""

    def __init__(self, config: Any, async_llm: AsyncLLM, exit_on_engine_death: bool = True):
        super().__init__(config)
        self.async_llm = async_llm
        self.exit_on_engine_death = exit_on_engine_death
        self.engine_died = False
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    async def on_tick(self, counter: int) -> bool:  # every 0.1 s
        if self.exit_on_engine_death and not self.engine_died and self.async_llm.is_dead:
            self.engine_died = True
            self.should_exit = True
            logger.error("the engine core is gone; shutting the server down")
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if self.loop is not None:  # in a signal handler: hand over to the loop, take no lock here
            self.loop.call_soon_threadsafe(self.async_llm.begin_shutdown)
        else:
            self.async_llm.begin_shutdown()
