"""One streamed /v1/completions request, timed (vLLM's request function and its output).

TTFT is the time to the first SSE chunk that carries a token; every later such chunk adds one
inter-token latency (ITL) gap. The output token count is the server's own (`usage` of the last
chunk, asked for with `stream_options.include_usage`), not a count of chunks. Times are
`time.monotonic()`, one clock for every client process of the host.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx


@dataclass
class RequestResult:
    """What one request measured; seconds. `ok` only when at least one token was streamed."""

    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0


def completion_payload(model: str, prompt: list[int], max_tokens: int, temperature: float) -> dict[str, Any]:
    """A token-id prompt that generates exactly `max_tokens` tokens (`ignore_eos`), streamed with usage."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def http_client() -> httpx.AsyncClient:
    """No timeout and no connection cap: the benchmark's own --max-concurrency is the only limit."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits, http2=False)


async def one_request(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], payload: dict[str, Any]
) -> RequestResult:
    """Send `payload` and time its stream; never raises (a failure is a result with `error`)."""
    res = RequestResult(prompt_len=len(payload["prompt"]))
    start = time.monotonic()  # one clock for every client process of the host
    res.start = start
    last = start
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                now = time.monotonic()
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])
                    return res
                if obj.get("choices"):
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if obj.get("usage"):
                    res.output_tokens = obj["usage"]["completion_tokens"]
        res.latency = time.monotonic() - start
        res.ok = res.ttft > 0
        if not res.ok:
            res.error = "no tokens streamed"
    except Exception as e:  # noqa: BLE001  (counted as a failed request)
        res.error = f"{type(e).__name__}: {e}"
    return res
