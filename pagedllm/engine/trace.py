"""Block lifecycle trace: one JSON line per ALLOCATE / REUSE / REACTIVATE / RELEASE / EVICT.

Off by default. When off, the block pool holds `None` instead of a Tracer and skips the
call entirely, so tracing costs nothing.
"""

from __future__ import annotations

import json
import sys
from typing import IO, Any


class Tracer:
    def __init__(self, sink: IO[str] | list[dict[str, Any]] | None = None) -> None:
        self.sink = sys.stderr if sink is None else sink

    def event(self, kind: str, block_id: int, seq_id: int | None, ref_cnt: int, num_free: int, group: int = 0) -> None:
        record = {
            "event": kind,
            "block_id": block_id,
            "seq_id": seq_id,
            "ref_cnt": ref_cnt,
            "num_free": num_free,
            "group": group,  # the KV-cache group (engine/kv_cache_groups.py) that holds the block
        }
        if isinstance(self.sink, list):
            self.sink.append(record)
        else:
            self.sink.write(json.dumps(record) + "\n")
