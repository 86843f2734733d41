"""Request timeline: when each stage of a request's life happened, for the latency breakdown.

Off unless `PAGEDLLM_TIMELINE=PREFIX` is set (envs.py). Then every process that serves writes
one JSON line per event to `PREFIX.<role>.<pid>.jsonl`: the API process (HTTP arrival, parsed
and tokenized, handed to the core, each step's outputs received and applied, each stream's task
resumed with its output, its events built and written) and
the engine core (a request received, each step scheduled, launched and resolved, its outputs
sent). Times are `time.monotonic()`, one clock for every process of a host (the benchmark
client's too: bench/request_func.py), so the files join on request ids into one timeline per
request (benchmarks/request_timeline.py). When off, the holders keep `None` and skip the call.

Events are buffered and written in batches (a write per event would be part of what is timed);
`close()` writes the rest, and so does the interpreter's exit.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from typing import Any

FLUSH_EVERY = 4096  # events held before a write


class Timeline:
    def __init__(self, prefix: str, role: str):
        self.path = f"{prefix}.{role}.{os.getpid()}.jsonl"
        self.role = role
        self._rows: list[dict[str, Any]] = []
        self._closed = False
        atexit.register(self.close)

    def event(self, ev: str, t: float | None = None, **fields: Any) -> None:
        """Record `ev` at time t (default: now) with its fields (request ids, step ids, counts)."""
        fields["ev"] = ev
        fields["t"] = time.monotonic() if t is None else t
        self._rows.append(fields)
        if len(self._rows) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        rows, self._rows = self._rows, []
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.flush()


def timeline_from_env(role: str) -> Timeline | None:
    """A Timeline for this process's `role` ("api", "core") when PAGEDLLM_TIMELINE is set, else None."""
    from pagedllm import envs

    prefix = envs.timeline_prefix()
    return None if prefix is None else Timeline(prefix, role)
