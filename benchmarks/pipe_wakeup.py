"""The floor under every cross-process stage of a request's timeline: one small message through a
multiprocessing pipe to a process that sleeps in its event loop, from send to read.

The API process and the engine core talk through such pipes (core_client.py), each side asleep
between messages when the load is light, so `submit_to_core` and `core_to_api` in
`benchmarks/request_path.py` cannot be shorter than this on the same host. A child process sends
a step-sized message every `--gap-ms` (the reader is asleep by then); the parent reads it with an
asyncio reader on the pipe (asyncio's loop, then uvloop's when installed), as the output handler
does. Prints and appends one JSON line.

    python benchmarks/pipe_wakeup.py [--messages 200] [--gap-ms 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any


def producer(conn: Any, n: int, gap_s: float) -> None:
    for _ in range(n):
        time.sleep(gap_s)
        conn.send(("step", [("cmpl-0", 0, [1234], None)], time.monotonic()))
    conn.send(None)


async def consume(conn: Any) -> list[float]:
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        while conn.poll(0):
            msg = conn.recv()
            if msg is None:
                loop.remove_reader(conn.fileno())
                done.set_result(None)
                return
            lags.append(time.monotonic() - msg[2])

    loop.add_reader(conn.fileno(), readable)
    await done
    return lags


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=200)
    ap.add_argument("--gap-ms", type=float, default=10.0)
    ap.add_argument("--out", default=None, help="append the result as one JSON line")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from pagedllm.bench.common import environment

    runners: dict[str, Any] = {"asyncio": asyncio.run}
    try:
        import uvloop

        runners["uvloop"] = uvloop.run
    except ImportError:
        pass
    result: dict[str, Any] = {"benchmark": "pipe_wakeup", "messages": args.messages, "gap_ms": args.gap_ms}
    for name, run in runners.items():
        r, w = mp.Pipe(duplex=False)
        child = mp.get_context("spawn").Process(target=producer, args=(w, args.messages, args.gap_ms / 1000))
        child.start()
        lags = sorted(run(consume(r)))
        child.join()
        result[name] = {
            "median_us": round(statistics.median(lags) * 1e6, 1),
            "p90_us": round(lags[int(0.9 * len(lags))] * 1e6, 1),
        }
    result.update(environment())
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
