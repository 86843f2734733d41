"""The server's own flags (`pagedllm serve`, `python -m pagedllm.entrypoints.openai.api_server`)
and the checks of the flags that go together, run before anything loads. The engine's flags come
from `pagedllm.entrypoints.args`; launcher.py runs the server."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

from pagedllm.entrypoints.args import USAGE_ERROR, CLIError, byte_size
from pagedllm.entrypoints.openai.guards import DEFAULT_MAX_REQUEST_BODY_SIZE


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
        "--api-server-count",
        type=_int_in(1, 64, "an integer in [1, 64]"),
        default=1,
        metavar="N",
        help="API processes (HTTP, tokenizing, detokenizing, streaming) over the one engine core, each on "
        "the same port (SO_REUSEPORT: the kernel spreads connections over them); /metrics adds up all of "
        "them. Default 1: one API process",
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
