"""The `pagedllm` command line: `generate`, `serve`, `bench throughput`, `bench serve`, `trace view`.

Flags follow vLLM's spellings. stdout carries only results (completions, JSON lines);
logs, progress bars and errors go to stderr. An error is one line, `pagedllm: error: ...`,
with exit code 2 for a usage error and 1 for a failure at run time; `--debug` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from pagedllm import __version__, envs
from pagedllm.entrypoints.args import RUNTIME_ERROR, USAGE_ERROR, CLIError, add_engine_args, engine_kwargs
from pagedllm.entrypoints.cli_generate import add_generate_args, run_generate
from pagedllm.entrypoints.logs import LOG_DATEFMT, LOG_FORMAT, StderrHandler

__all__ = ["main", "add_engine_args", "engine_kwargs", "SERVER_MODULE"]

logger = logging.getLogger("pagedllm")

SERVER_MODULE = "pagedllm.entrypoints.openai.launcher"  # add_server_args(parser), run_server(args): `pagedllm serve`


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `pagedllm: error: <message> (see '<prog> --help')`."""

    help_prog: str | None = None  # the top-level parser points at the subcommand's help

    def error(self, message: str):
        raise CLIError(f"{message} (see '{self.help_prog or self.prog} --help')", USAGE_ERROR)


# ---- optional subcommands implemented in other modules -----------------------------------
def _import_optional(module: str, what: str, extra: str | None):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise CLIError(f"'{what}' is not available: this installation of pagedllm has no {module}") from e
        hint = f"; install it with: pip install 'pagedllm[{extra}]'" if extra else ""
        raise CLIError(f"'{what}' needs the Python package {e.name!r}{hint}") from e


_OPTIONAL = {
    # subcommand path: (module, extra, add-args function, run function, add_engine_args first?)
    # (a bench module that builds an LLM calls add_engine_args itself, for the flags it honours)
    ("serve",): (SERVER_MODULE, "serve", "add_server_args", "run_server", True),
    ("bench", "throughput"): ("pagedllm.bench.throughput", None, "add_args", "main", False),
    ("bench", "serve"): ("pagedllm.bench.serving", "serve", "add_args", "main", False),
    ("bench", "sharing"): ("pagedllm.bench.sharing_cli", None, "add_args", "main", False),
    ("bench", "offload"): ("pagedllm.bench.offload", None, "add_args", "main", False),
    ("trace", "view"): ("pagedllm.entrypoints.cli_trace", None, "add_args", "run", False),
}


def _subcommand_words(argv: list[str]) -> list[str]:
    """The leading positional words of argv (global flags skipped): which parsers to fill."""
    words: list[str] = []
    for a in argv:
        if a == "--":
            break
        if a.startswith("-"):
            if words:
                break
            continue
        words.append(a)
        if len(words) == 2:
            break
    return words


def _fill_optional(p: argparse.ArgumentParser, path: tuple[str, ...], wanted: list[str]) -> None:
    """Add the arguments of a subcommand whose code lives elsewhere, only when it is the one
    being run (so `pagedllm generate` never imports the server). A missing module is
    reported only when that subcommand is run."""
    module, extra, add_fn, run_fn, engine_first = _OPTIONAL[path]
    if list(path) != wanted[: len(path)]:
        return
    mod = _import_optional(module, "pagedllm " + " ".join(path), extra)  # CLIError if missing
    if engine_first:
        add_engine_args(p)
    getattr(mod, add_fn)(p)
    p.set_defaults(_run=getattr(mod, run_fn))


# ---- the parser ---------------------------------------------------------------------------
def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    wanted = _subcommand_words(list(argv or []))
    debug = _Parser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks and DEBUG logs")
    parser = _Parser(
        prog="pagedllm",
        parents=[debug],
        description="pagedllm: vLLM's design (PagedAttention, prefix caching, continuous batching) in readable Python.",
        epilog="Run 'pagedllm COMMAND --help' for a command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    parser.help_prog = " ".join(["pagedllm"] + wanted[: 2 if wanted[:1] in (["bench"], ["trace"]) else 1])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    g = sub.add_parser(
        "generate",
        parents=[debug],
        help="complete prompts (streams one, batches several)",
        description="Complete prompts with a local model (the bundled one by default). "
        "One prompt streams to stdout; several prompts, '-' or --input run "
        "as one batch with a progress bar on stderr.",
        epilog="examples:\n"
        "  pagedllm generate 'def fibonacci('\n"
        "  pagedllm generate --temperature 0 --max-tokens 64 'import '\n"
        "  printf 'import \\ndef \\n' | pagedllm generate - --json\n"
        "  pagedllm generate --input prompts.txt --model ~/models/Qwen3-0.6B --device cuda",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_generate_args(g)
    add_engine_args(g)
    g.set_defaults(_run=run_generate)

    # no conflict_handler="resolve": a subcommand flag that redefines an engine flag is an error
    s = sub.add_parser("serve", parents=[debug], help="OpenAI-compatible HTTP server")
    _fill_optional(s, ("serve",), wanted)

    b = sub.add_parser(
        "bench",
        parents=[debug],
        help="benchmarks: throughput (offline), serve (HTTP), sharing (KV blocks), offload (host KV tier)",
    )
    bsub = b.add_subparsers(dest="bench_command", metavar="BENCHMARK", parser_class=_Parser)
    bt = bsub.add_parser("throughput", parents=[debug], help="offline throughput of LLM.generate")
    _fill_optional(bt, ("bench", "throughput"), wanted)
    bs = bsub.add_parser(
        "serve",
        parents=[debug],
        help="load test of a running server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _fill_optional(bs, ("bench", "serve"), wanted)
    bsh = bsub.add_parser(
        "sharing",
        parents=[debug],
        help="KV blocks saved by sharing in parallel sampling and beam search (the vLLM paper's Fig. 15; CPU, no model)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _fill_optional(bsh, ("bench", "sharing"), wanted)
    bo = bsub.add_parser(
        "offload",
        parents=[debug],
        help="the host KV tier: multi-turn chat hit rates and TTFT per tier size, swap vs recompute, copy bandwidth",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _fill_optional(bo, ("bench", "offload"), wanted)
    b.set_defaults(_help=b)

    t = sub.add_parser("trace", parents=[debug], help="KV block traces (--trace-blocks): view")
    tsub = t.add_subparsers(dest="trace_command", metavar="ACTION", parser_class=_Parser)
    tv = tsub.add_parser("view", parents=[debug], help="draw a block trace as a timeline (HTML, SVG, PNG)")
    _fill_optional(tv, ("trace", "view"), wanted)
    t.set_defaults(_help=t)
    return parser


# ---- logging and main -------------------------------------------------------------------
def setup_logging(debug: bool) -> None:
    level = envs.logging_level("DEBUG" if debug else "INFO")
    if not any(isinstance(h, StderrHandler) for h in logger.handlers):  # also LLM's default one (logs.py)
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATEFMT))
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if debug else getattr(logging, level, logging.INFO))


def _error(message: str) -> None:
    message = " ".join(str(message).split()) or "unknown error"
    print(f"pagedllm: error: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv[: argv.index("--")] if "--" in argv else "--debug" in argv
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        setup_logging(debug)
        if getattr(args, "_help", None) is not None and getattr(args, "_run", None) is None:  # `bench`, `trace`
            args._help.print_help()
            return USAGE_ERROR
        if getattr(args, "_run", None) is None:
            parser.print_help()
            return 0 if not argv else USAGE_ERROR
        return int(args._run(args) or 0)
    except SystemExit as e:  # --help, --version, or a callee's sys.exit
        return e.code if isinstance(e.code, int) else (0 if e.code is None else RUNTIME_ERROR)
    except KeyboardInterrupt:
        if debug:
            raise
        _error("interrupted")
        return 130
    except BrokenPipeError:  # `pagedllm generate ... | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except CLIError as e:
        if debug and e.code != USAGE_ERROR:
            raise
        _error(str(e))
        return e.code
    except ValueError as e:
        if debug:
            raise
        _error(str(e))
        return RUNTIME_ERROR
    except Exception as e:  # noqa: BLE001  (one line unless --debug)
        if debug:
            raise
        _error(f"{type(e).__name__}: {e}")
        return RUNTIME_ERROR


if __name__ == "__main__":
    sys.exit(main())
