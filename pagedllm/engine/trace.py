"""Block lifecycle trace: one JSON line per ALLOCATE / REUSE / REACTIVATE / RELEASE / EVICT, and
with the host tier (host_tier.py) OFFLOAD / LOAD (a GPU block and the host block it is copied
to or from: `host_block_id`) and HOST_EVICT (a host block whose cached KV is dropped; its
`block_id` is the host block's, `num_free` the host tier's), and with speculative decoding
(spec_verify.py) ROLLBACK: a block that held only rejected proposals, released right after.

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

    def event(
        self,
        kind: str,
        block_id: int,
        seq_id: int | None,
        ref_cnt: int,
        num_free: int,
        group: int = 0,
        host_block_id: int | None = None,
    ) -> None:
        record: dict[str, Any] = {
            "event": kind,
            "block_id": block_id,
            "seq_id": seq_id,
            "ref_cnt": ref_cnt,
            "num_free": num_free,
            "group": group,  # the KV-cache group (engine/kv_cache_groups.py) that holds the block
        }
        if host_block_id is not None:
            record["host_block_id"] = host_block_id
        if isinstance(self.sink, list):
            self.sink.append(record)
        else:
            self.sink.write(json.dumps(record) + "\n")
