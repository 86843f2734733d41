"""Where start-up's seconds go: named phases, timed (`LLM(...)` logs them once ready and keeps
them as `LLM.startup_seconds`; benchmarks/startup.py reads them). Torch-free: the worker passes a
`sync` that waits for the device, so a phase's queued kernels count in that phase."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class StartupTimes:
    def __init__(self, sync: Callable[[], None] = lambda: None):
        self.sync = sync
        self.seconds: dict[str, float] = {}  # phase -> seconds, in the order the phases began

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

    def summary(self) -> str:
        """'a 1.23 s, b 0.45 s' (phases under 5 ms left out)."""
        return ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items() if v >= 0.005)
