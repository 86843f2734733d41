"""pagedllm's log lines (the "pagedllm" logger) made visible where nobody configured logging.

A Python program that builds an `LLM` and never touches `logging` would otherwise see only
warnings (Python's last-resort handler), never the INFO lines that say what the engine did (the
KV cache size, the sampling defaults taken from the model). As vLLM does for its own logger,
`LLM` adds one stderr handler to the "pagedllm" logger, unless a handler would already print
its records: the CLI's or the server's (on the "pagedllm" logger) or the application's own (on
an ancestor such as the root logger, e.g. after `logging.basicConfig`), which keeps full
control. Once added, the handler itself is one that would print, so it is added once per
process; the root logger is never touched.
"""

from __future__ import annotations

import logging
import sys

from pagedllm import envs

LOG_FORMAT, LOG_DATEFMT = "%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"


class StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (so redirection and test capture work)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def ensure_log_handler() -> None:
    """Add the stderr handler to the "pagedllm" logger when nothing would print its records;
    its level then comes from PAGEDLLM_LOGGING_LEVEL (default INFO) unless one was set."""
    logger = logging.getLogger("pagedllm")
    if logger.hasHandlers():
        return
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATEFMT))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        level = logging.getLevelName(envs.logging_level("INFO"))
        logger.setLevel(level if isinstance(level, int) else logging.INFO)
