"""Kept importable for the callers not yet moved to `pagedllm.entrypoints.openai` (cli.py's
`serve` table, tests/server/test_engine_death.py); the server lives in that package."""

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.launcher import add_server_args, run_server

__all__ = ["add_server_args", "build_app", "run_server"]
