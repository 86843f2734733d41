"""AsyncLLM's lifecycle states and the errors its callers see (the server maps them to 429/503/500)."""

from __future__ import annotations

import enum


class QueueFullError(RuntimeError):
    """More requests are waiting than max_queue_len allows (the server answers 429)."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down, stopped, or its process died: no new requests, and open
    streams end with this error (the server answers 503)."""


class EngineStepError(RuntimeError):
    """The engine raised while running this request (a bug, not the caller's mistake)."""


class EngineState(enum.Enum):
    RUNNING = "running"
    STOPPING = "stopping"  # asked to stop; the core has not said Bye yet
    STOPPED = "stopped"  # the core is gone, as asked
    DEAD = "dead"  # the core is gone unasked
