"""`pagedllm serve`: the flags (server_args.py), then one API process or N over one engine core.

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
With `--api-server-count N` (N > 1) this process becomes the front of N API processes over one
engine core (api_processes.py); steps 0-3 hold for the whole server.
"""

from __future__ import annotations

import argparse
import logging

from pagedllm import envs
from pagedllm.entrypoints.args import engine_kwargs
from pagedllm.entrypoints.async_llm import AsyncLLM
from pagedllm.entrypoints.logs import LOG_DATEFMT, LOG_FORMAT
from pagedllm.entrypoints.openai.api_processes import run_api_servers
from pagedllm.entrypoints.openai.http_server import AbortingServer, bind_sockets, serve, uvicorn_config
from pagedllm.entrypoints.openai.server_args import (
    add_server_args,
    chat_template_text,
    json_list,
    serve_model,
    tool_parser_of,
)

__all__ = [
    "AbortingServer",
    "add_server_args",
    "chat_template_text",
    "json_list",
    "run_server",
    "serve_model",
    "tool_parser_of",
    "uvicorn_config",
]

logger = logging.getLogger("pagedllm")


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
    if getattr(args, "api_server_count", 1) > 1:
        return run_api_servers(args, template, tool_parser, keep_alive)
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
    return serve(args, sockets, async_llm, template, tool_parser, keep_alive)
