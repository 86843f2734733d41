"""`python -m pagedllm.entrypoints.openai.api_server [flags]`: the server's entry module under
vLLM's name, the same as `pagedllm serve [flags]`. The routes are in routes.py (`build_app`), the
process (flags, uvicorn, signals, shutdown) in launcher.py; this module only joins the two.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.routes import build_app

__all__ = ["build_app", "main"]


def main(argv: list[str] | None = None) -> int:
    """`python -m pagedllm.entrypoints.openai.api_server [flags]` = `pagedllm serve [flags]`."""
    import argparse
    import sys

    from pagedllm.entrypoints.args import CLIError, add_engine_args
    from pagedllm.entrypoints.openai.launcher import add_server_args, run_server

    parser = argparse.ArgumentParser(prog="python -m pagedllm.entrypoints.openai.api_server")
    add_engine_args(parser)
    add_server_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_server(args)
    except CLIError as e:  # a busy port, a dead engine: one line, as `pagedllm serve` prints it
        print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
        return e.code


if __name__ == "__main__":
    raise SystemExit(main())
