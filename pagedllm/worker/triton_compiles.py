"""PAGEDLLM_LOG_TRITON_COMPILES=1: log each Triton kernel this process compiles, and how long it took.

Triton compiles a kernel the first time it meets a new specialization (an integer argument that
becomes 1 or a multiple of 16, a new constexpr such as a tile size, a new dtype). A compile after
start-up stalls the step that launched it, for as long as the compile takes (the on-disk cache
makes a repeat in a later process cheap, not free). Logging them tells whether a slow first run
of a benchmark is compiles. The hooks are Triton's (`triton.knobs.runtime.jit_cache_hook`, called
before a compile that the in-memory cache cannot serve, and `jit_post_compile_hook`, after it);
on a Triton without them this logs that it cannot.
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("pagedllm")


class CompileLog:
    """The two hooks; `compiles` counts them and `seconds` sums their times."""

    def __init__(self) -> None:
        self.started: dict[Any, float] = {}
        self.compiles = 0
        self.seconds = 0.0

    @staticmethod
    def _name(kwargs: dict) -> str:
        fn = kwargs.get("fn")
        name = getattr(getattr(fn, "jit_function", fn), "__name__", None) or str(kwargs.get("repr", "?"))
        return name

    def before(self, *args: Any, **kwargs: Any) -> bool:
        self.started[(self._name(kwargs), str(kwargs.get("key")))] = time.perf_counter()
        return False  # compile as usual

    def after(self, *args: Any, **kwargs: Any) -> bool:
        name = self._name(kwargs)
        t0 = self.started.pop((name, str(kwargs.get("key"))), None)
        took = time.perf_counter() - t0 if t0 is not None else 0.0
        self.compiles += 1
        self.seconds += took
        logger.info("triton compiled %s in %.3f s (%s)", name, took, str(kwargs.get("repr", ""))[:200])
        return False


def install() -> CompileLog | None:
    """Install the hooks (replacing any others). None when this Triton has no such hooks."""
    try:
        from triton import knobs
    except ImportError:
        logger.info("PAGEDLLM_LOG_TRITON_COMPILES: this Triton has no runtime hooks; nothing is logged")
        return None
    log = CompileLog()
    knobs.runtime.jit_cache_hook = log.before
    knobs.runtime.jit_post_compile_hook = log.after
    return log
