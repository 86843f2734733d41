"""Running the server as a process: the server's flags, uvicorn, signals, shutdown.

`add_server_args(parser)` adds the server's own flag group (the engine's flags come from
`pagedllm.entrypoints.args`); `run_server(args)` loads the model, serves until SIGTERM/SIGINT,
then aborts every in-flight request so open streams end cleanly (finish_reason "abort", then
[DONE]) and the process exits 0 with its engine core process gone.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import uvicorn

from pagedllm import envs
from pagedllm.entrypoints.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.api_server import build_app

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
        help="require 'Authorization: Bearer KEY' on /v1/*; unset: $PAGEDLLM_API_KEY, else no key",
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
    ends cleanly) and return 0. `args` holds the engine flags and the server flags."""
    from pagedllm.entrypoints.args import engine_kwargs  # the engine's flag table, owned by the CLI

    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(asctime)s %(message)s", datefmt="%m-%d %H:%M:%S")
    logger.setLevel(level)
    async_llm = AsyncLLM(max_queue_len=args.max_queue_len, engine_process=args.engine_process, **engine_kwargs(args))
    name = args.served_model_name or args.model or os.path.basename(os.path.normpath(str(async_llm.model_path)))
    api_key = args.api_key or envs.api_key()
    app = build_app(async_llm, name, api_key)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=str(args.log_level).lower(),
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
        ws="none",
        lifespan="off",
        access_log=not args.disable_uvicorn_access_log,
    )
    server = AbortingServer(config, async_llm)
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


class AbortingServer(uvicorn.Server):
    """A uvicorn.Server whose exit signal also aborts every in-flight request, so open streams
    end and graceful shutdown does not wait on them."""

    def __init__(self, config: Any, async_llm: AsyncLLM):
        super().__init__(config)
        self.async_llm = async_llm
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if self.loop is not None:  # in a signal handler: hand over to the loop, take no lock here
            self.loop.call_soon_threadsafe(self.async_llm.begin_shutdown)
        else:
            self.async_llm.begin_shutdown()
