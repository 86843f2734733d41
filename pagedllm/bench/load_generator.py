"""The load generator: send every prompt at its arrival time, from one or several processes.

Plain asyncio + httpx (not the openai client, whose per-chunk overhead would be measured too).
One such process spends ~50 us of CPU per SSE event (measured on CPU), so alone it would
saturate near the 15k events/s of 120 req/s x 128 tokens; the load is therefore spread over
`client_processes` spawned processes. Request i goes to process i % N, so each gets the same mix
of prompts and arrival times; all of them start at one common `time.monotonic()` instant and
the results come back in request order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.bench.request_func import RequestResult, completion_payload, http_client, one_request

if TYPE_CHECKING:
    from multiprocessing.connection import Connection


@dataclass(frozen=True)
class Load:
    """What a client process needs to send its requests (picklable: it crosses the spawn)."""

    url: str  # the /v1/completions endpoint
    headers: dict[str, str]
    model: str
    temperature: float
    output_len: int
    max_concurrency: int | None  # requests in flight in this process; None: no cap

    def payload(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return completion_payload(self.model, prompt, max_tokens, self.temperature)


def completions_load(
    base_url: str,
    model: str,
    api_key: str | None,
    temperature: float,
    output_len: int,
    max_concurrency: int | None,
) -> Load:
    """The Load of a server at `base_url` (its /v1/completions, a bearer header when `api_key`)."""
    return Load(
        base_url.rstrip("/") + "/v1/completions",
        {"Authorization": f"Bearer {api_key}"} if api_key else {},
        model,
        temperature,
        output_len,
        max_concurrency,
    )


async def _drive(load: Load, items: list[tuple[list[int], float]], t0: float) -> tuple[list[RequestResult], float]:
    """Send each prompt at t0 + its offset (time.monotonic()); returns the results and the end time."""
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    async with http_client() as client:

        async def scheduled(prompt: list[int], at: float) -> RequestResult:
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                return await one_request(client, load.url, load.headers, load.payload(prompt, load.output_len))
            async with sem:
                return await one_request(client, load.url, load.headers, load.payload(prompt, load.output_len))

        results = await asyncio.gather(*(scheduled(p, at) for p, at in items))
    return list(results), time.monotonic()


def _client_process(conn: Connection, load: Load, items: list[tuple[list[int], float]]) -> None:
    """A spawned load-generator process: report ready, wait for the common start time, run."""
    conn.send("ready")
    t0 = conn.recv()
    conn.send(asyncio.run(_drive(load, items, t0)))
    conn.close()


def client_process_count(requested: int, num_prompts: int) -> int:
    """`requested` (at most one per prompt), or for 0: min(4, CPUs / 4, prompts / 64), at least 1."""
    if requested > 0:
        return min(requested, num_prompts)
    return max(1, min(4, (os.cpu_count() or 1) // 4, num_prompts // 64))


def warmup(load: Load, prompts: list[list[int]], num_requests: int) -> None:
    """Send `num_requests` short requests (16 prompt tokens, 4 output tokens), one after another; untimed."""

    async def send() -> None:
        async with http_client() as client:
            for i in range(num_requests):
                r = await one_request(client, load.url, load.headers, load.payload(prompts[i % len(prompts)][:16], 4))
                if not r.ok:
                    raise RuntimeError(f"warm-up request failed: {r.error}")

    asyncio.run(send())


def run_load(
    load: Load, prompts: list[list[int]], offsets: list[float], client_processes: int
) -> tuple[list[RequestResult], float]:
    """Send prompt i at offsets[i] s from a common start, over `client_processes` processes.

    Returns the results in prompt order and the duration (s): from the start to the end of the
    last process's last request. `load.max_concurrency` is the cap over all processes together.
    """
    n = client_processes
    if n == 1:
        t0 = time.monotonic()
        results, end = asyncio.run(_drive(load, list(zip(prompts, offsets, strict=False)), t0))
        return results, end - t0
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    if load.max_concurrency:  # the cap is shared out evenly
        load = dataclasses.replace(load, max_concurrency=-(-load.max_concurrency // n))
    conns: list[Connection] = []
    procs: list[Any] = []
    try:
        for i in range(n):  # request i goes to process i % n: each gets the same mix
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_client_process,
                args=(child, load, list(zip(prompts[i::n], offsets[i::n], strict=False))),
                name=f"bench-client-{i}",
                daemon=True,
            )
            p.start()
            child.close()
            conns.append(parent)
            procs.append(p)
        for c in conns:
            if c.recv() != "ready":
                raise RuntimeError("a load-generator process failed to start")
        t0 = time.monotonic() + 0.05
        for c in conns:
            c.send(t0)
        parts = [c.recv() for c in conns]
    except EOFError:
        raise RuntimeError("a load-generator process died") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    merged: list[RequestResult] = [RequestResult() for _ in prompts]
    for i, (part, _) in enumerate(parts):
        merged[i::n] = part
    return merged, max(end for _, end in parts) - t0
