"""Running the server as a process: the server's flags, the listening socket, uvicorn, signals,
shutdown.

`add_server_args(parser)` adds the positional MODEL (`pagedllm serve MODEL`, as `vllm serve`)
and the server's own flag group (the engine's flags come from `pagedllm.entrypoints.args`);
`run_server(args)`:
0. checks the flags that go together (MODEL and --model, the tool-call flags) and reads
   --chat-template, so that a mistake there costs no model load;
1. binds the port first, so a port in use is a one-line CLIError (exit 1) in a second, not after
   the model has loaded; the bound (not yet listening) socket is handed to uvicorn, so no other
   process can take the port in between;
2. loads the model (the engine core process), serves until SIGTERM/SIGINT, then aborts every
   in-flight request so open streams end cleanly (finish_reason "abort", then [DONE]) and
   returns 0 with its engine core process gone;
3. if the engine core dies instead, its open streams end with an `engine_dead` error event and
   the server shuts down and raises CLIError (exit 1), so that a supervisor restarts it, as vLLM
   does; `--keep-alive-on-engine-death` (or PAGEDLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1, vLLM's
   VLLM_KEEP_ALIVE_ON_ENGINE_DEATH) keeps it up answering 503 instead.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import signal
import socket
from collections.abc import Callable
from typing import Any

import uvicorn

from pagedllm import envs
from pagedllm.entrypoints.args import USAGE_ERROR, CLIError, byte_size, engine_kwargs
from pagedllm.entrypoints.async_llm import AsyncLLM
from pagedllm.entrypoints.logs import LOG_DATEFMT, LOG_FORMAT
from pagedllm.entrypoints.openai.connections import head_deadline_protocol
from pagedllm.entrypoints.openai.guards import DEFAULT_MAX_REQUEST_BODY_SIZE, is_loopback
from pagedllm.entrypoints.openai.routes import build_app

logger = logging.getLogger("pagedllm")


def _int_in(lo: int, hi: int | None, what: str) -> Callable[[str], int]:
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


def json_list(text: str) -> list[str]:
    """`'["https://a.example", "http://localhost:3000"]'` -> the list (vLLM's spelling of the CORS flags)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r}")
    return value


TOOL_CALL_PARSERS = ("hermes",)  # <tool_call>{...}</tool_call> (Hermes, Qwen)


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as in `vllm serve MODEL`: the same as --model (giving both, different, is an error)",
    )
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
        help="require 'Authorization: Bearer KEY' on /v1/*; unset: $PAGEDLLM_API_KEY, else no key",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model names clients may send (the first is the one /v1/models lists first and /metrics "
        "labels); unset: the model as given, else the directory's name",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="the chat template of /v1/chat/completions instead of the tokenizer's: a file, or the Jinja "
        "template itself on one line",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": tool calls parsed from the model\'s output (needs --tool-call-parser)',
    )
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS, help="the format of tool calls")
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests pass their own chat_template (a Jinja template the server runs); off: such a request is a 400",
    )
    g.add_argument(
        "--disable-log-requests",
        dest="log_requests",
        action="store_false",
        default=True,
        help="no INFO line per request (request id, prompt length, sampling parameters); on by default",
    )
    g.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action="store_true",
        help="the INFO line per request (the default; vLLM's newer spelling)",
    )
    g.add_argument(
        "--allowed-origins",
        type=json_list,
        default=None,
        metavar="JSON",
        help="CORS: origins whose web pages may call the API, a JSON list ('[\"https://app.example\"]', "
        "'[\"*\"]' any); unset: no CORS headers, so browsers keep other origins out (vLLM allows any)",
    )
    g.add_argument(
        "--allowed-methods", type=json_list, default=["*"], metavar="JSON", help="CORS: allowed methods, a JSON list"
    )
    g.add_argument(
        "--allowed-headers", type=json_list, default=["*"], metavar="JSON", help="CORS: allowed headers, a JSON list"
    )
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, auth headers)")
    g.add_argument(
        "--max-queue-len",
        type=_int_in(0, None, "an integer >= 0"),
        default=None,
        help="answer 429 while this many requests are waiting; unset: no limit",
    )
    g.add_argument(
        "--stream-interval",
        type=_int_in(1, None, "an integer >= 1"),
        default=1,
        metavar="N",
        help="stream a request's tokens N at a time after its first (fewer, larger SSE chunks: less "
        "CPU a token in the API process); default 1: each token as it is sampled",
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
        "--keep-alive-on-engine-death",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="if the engine core dies, keep serving 503s instead of exiting with code 1 (the default, so "
        "that a supervisor restarts the server); unset: $PAGEDLLM_KEEP_ALIVE_ON_ENGINE_DEATH",
    )
    g.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="NAMES",
        help="comma-separated host names the Host header may carry besides localhost, 127.0.0.1 and [::1] "
        "('*': any); unset: loopback names only when bound to a loopback address, else any",
    )
    g.add_argument(
        "--max-request-body-size",
        type=byte_size,
        default=DEFAULT_MAX_REQUEST_BODY_SIZE,
        metavar="BYTES",
        help="larger request bodies get 413, e.g. 64MiB (default: 32MiB)",
    )
    g.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine in its own process (--no-engine-process: on a thread of the server "
        "process, sharing its GIL; for debugging)",
    )
    return parser


def serve_model(args: argparse.Namespace) -> str | None:
    """The model of `pagedllm serve [MODEL] [--model M]`: either spelling; both only when equal."""
    tag, flag = args.model_tag, args.model
    if tag is not None and flag is not None and tag != flag:
        raise CLIError(f"the model is given twice and differs: {tag!r} (positional) and --model {flag!r}", USAGE_ERROR)
    return tag if tag is not None else flag


def tool_parser_of(args: argparse.Namespace) -> str | None:
    """The tool-call parser the server uses for tool_choice "auto": vLLM's two flags go together."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise CLIError("--enable-auto-tool-choice needs --tool-call-parser (hermes)", USAGE_ERROR)
    if args.tool_call_parser is not None and not args.enable_auto_tool_choice:
        raise CLIError(
            f"--tool-call-parser {args.tool_call_parser} is used only with --enable-auto-tool-choice", USAGE_ERROR
        )
    return args.tool_call_parser


def chat_template_text(value: str) -> str:
    """--chat-template: the file's text, or the value itself when it is a template (it holds `{`,
    `}` or a newline, as vLLM tells them apart); a name that is neither is refused."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"--chat-template: cannot read {value!r}: {e}", USAGE_ERROR) from None
    if any(c in value for c in "{}\n"):
        return value
    raise CLIError(f"--chat-template {value!r}: no such file, and not a Jinja template", USAGE_ERROR)


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


def run_server(args: argparse.Namespace) -> int:
    """Bind, load the model, serve until SIGTERM/SIGINT, then abort in-flight requests (each stream
    ends cleanly) and return 0. CLIError when the port cannot be bound, and when the engine core
    died (unless --keep-alive-on-engine-death). `args` holds the engine flags and the server flags."""
    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        logging.basicConfig(format=LOG_FORMAT, datefmt=LOG_DATEFMT)
    logger.setLevel(level)
    keep_alive = args.keep_alive_on_engine_death
    if keep_alive is None:
        keep_alive = envs.keep_alive_on_engine_death()
    args.model = serve_model(args)
    tool_parser = tool_parser_of(args)
    template = None if args.chat_template is None else chat_template_text(args.chat_template)
    sockets = bind_sockets(args.host, args.port)  # before the model loads: a busy port fails at once
    try:
        async_llm = AsyncLLM(
            max_queue_len=args.max_queue_len,
            stream_interval=args.stream_interval,
            engine_process=args.engine_process,
            log_requests=args.log_requests,
            **engine_kwargs(args),
        )
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    if template is not None:
        if async_llm.tokenizer is None:
            async_llm.shutdown()
            raise CLIError("--chat-template: the model has no tokenizer, so it cannot serve chat")
        async_llm.tokenizer.chat_template = template
    names = args.served_model_name or [args.model or os.path.basename(os.path.normpath(str(async_llm.model_path)))]
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
    host, port = sockets[0].getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    shown_names = ", ".join(repr(n) for n in names)
    logger.info(
        "Serving model %s on http://%s:%d/v1%s", shown_names, shown, port, " (API key required)" if api_key else ""
    )
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
