"""The OpenAI-compatible server through the official `openai` client (sync and async) and raw
HTTP: answers, streaming, usage, errors, concurrency, disconnects, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time

import httpx
import openai
import pytest

from tests.server.helpers import API_KEY, MODEL_NAME, fresh_scrape, metric, scrape

PROMPT = "def fibonacci(n):\n    "
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def n_tokens(live, text: str) -> int:
    return len(live.tokenizer.encode(text, add_special_tokens=False))


# ---- happy paths -------------------------------------------------------------------------
def test_models_and_health(live, client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert httpx.get(live.url + "/health", timeout=60).status_code == 200  # no key needed


def test_completion_streamed_equals_non_streamed(live, client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == n_tokens(live, PROMPT)
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_completion_token_id_prompts_and_batches(live, client):
    ids = live.tokenizer.encode(PROMPT, add_special_tokens=False)
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, **GREEDY)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    batch = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "import os\n"], max_tokens=6, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.completion_tokens == 12


def test_stop_strings(client):
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, **GREEDY).choices[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    assert stop.strip(), f"degenerate completion {base!r}"
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, stop=[stop], **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == base[: base.find(stop)]
    streamed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, stop=stop, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed) == base[: base.find(stop)]


def test_chat_streamed_equals_non_streamed_with_usage(live, client):
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Write a function that adds two numbers."},
    ]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=10, **GREEDY)
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.choices[0].finish_reason == "length"
    prompt = live.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert full.usage.prompt_tokens == n_tokens(live, prompt) and full.usage.completion_tokens == 10
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == msg.content
    assert chunks[-2].choices[0].finish_reason == "length"


def test_include_usage_on_completions_stream(client):
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=5, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_async_client_and_seeded_sampling(live):
    async def run():
        async with openai.AsyncOpenAI(base_url=live.base_url, api_key=API_KEY, max_retries=0) as c:
            kw = dict(
                model=MODEL_NAME,
                prompt=PROMPT,
                max_tokens=8,
                temperature=1.0,
                seed=1234,
                extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01, "min_tokens": 8},
            )
            a, b = await asyncio.gather(c.completions.create(**kw), c.completions.create(**kw))
            s = await c.completions.create(stream=True, **kw)
            streamed = "".join([ch.choices[0].text async for ch in s])
            return a, b, streamed

    a, b, streamed = asyncio.run(run())
    assert a.choices[0].text == b.choices[0].text == streamed
    assert a.usage.completion_tokens == 8


# ---- errors ------------------------------------------------------------------------------
def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_auth(live):
    bad = openai.OpenAI(base_url=live.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    _error(httpx.post(live.base_url + "/completions", json={"prompt": "x"}, timeout=60), 401)
    _error(httpx.get(live.base_url + "/models", headers={"Authorization": "Bearer " + API_KEY[:-1]}, timeout=60), 401)
    assert httpx.get(live.url + "/metrics", timeout=60).status_code == 200


@pytest.mark.parametrize(
    "body, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"stop": [1, 2]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"seed": 2**70}, "seed"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"best_of": 3, "stream": True}, "best_of"),
        ({"echo": "yes"}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"priority": 1}, "priority"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_completion_values_are_400_naming_the_field(http, body, param):
    req = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, **body}
    assert _error(http.post("/v1/completions", json=req), 400)["param"] == param


def test_openai_client_sees_bad_request_errors(client):
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, n=2, best_of=1)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2, top_logprobs=2
        )
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, top_p=5, stream=True)


def test_prompt_too_long_is_400(live, http):
    ids = [1] * (live.max_model_len + 5)
    err = _error(http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 2}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    # a request that fits the context but not the whole KV cache (the fixture makes the cache the smaller)
    kv_tokens = live.async_llm.num_kv_blocks * live.async_llm.block_size
    assert kv_tokens < live.max_model_len - 3
    too_many_blocks = {"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": kv_tokens}
    err = _error(http.post("/v1/completions", json=too_many_blocks), 400)
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": kv_tokens}
    err = _error(http.post("/v1/chat/completions", json=chat), 400)
    assert err["param"] == "max_completion_tokens" and err["code"] == "context_length_exceeded"


def test_errors_from_deep_validation_name_the_field_by_attribute(live, http):
    """Errors raised by SamplingParams and the input processor reach the client with the field as
    the client spelled it, though their messages name another (`max_tokens`, `prompt`)."""
    kv_tokens = live.async_llm.num_kv_blocks * live.async_llm.block_size
    vocab = live.async_llm.input_processor.vocab_size
    hi = [{"role": "user", "content": "hi"}]
    long_text = " ".join(str(i) for i in range(live.max_model_len))  # at least one token per number
    cases = [  # (path, body, param, code, a word the message must not contain)
        (
            "/v1/completions",
            {"prompt": [1, 2, 3], "max_tokens": kv_tokens},
            "max_tokens",
            "context_length_exceeded",
            None,
        ),
        ("/v1/completions", {"prompt": PROMPT, "top_p": 1.5}, "top_p", None, None),
        ("/v1/completions", {"prompt": PROMPT, "seed": -(2**63) - 1}, "seed", None, None),
        ("/v1/completions", {"prompt": [[1, 2], [vocab]]}, "prompt", None, None),
        ("/v1/completions", {"prompt": PROMPT, "min_tokens": 9, "max_tokens": 2}, "min_tokens", None, None),
        (
            "/v1/chat/completions",
            {"messages": hi, "max_completion_tokens": kv_tokens},
            "max_completion_tokens",
            "context_length_exceeded",
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": hi, "max_completion_tokens": 0},
            "max_completion_tokens",
            None,
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": long_text}]},
            "messages",
            "context_length_exceeded",
            "messages",
        ),
    ]
    for path, body, param, code, absent in cases:
        err = _error(http.post(path, json={"model": MODEL_NAME, **body}), 400)
        assert (err["param"], err["code"]) == (param, code), (path, body, err)
        if absent is not None:
            assert absent not in err["message"], err  # the field's name came from the attributes


def test_unknown_model_is_404(client, http):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt=PROMPT, max_tokens=2)
    assert (
        _error(http.post("/v1/chat/completions", json={"model": "nope", "messages": []}), 404)["code"]
        == "model_not_found"
    )
    _error(http.get("/v1/no-such-route"), 404)


def test_malformed_requests_are_4xx_and_the_server_stays_healthy(live, http, client):
    for path in ("/v1/completions", "/v1/chat/completions"):
        for raw in (b"{", b"not json", b"[1, 2]", b'"text"', b"", b'{"prompt": NaN}', b"\xff\xfe"):
            resp = http.post(path, content=raw, headers={"Content-Type": "application/json"})
            _error(resp, 400)
    chat = [
        {"messages": "hi"},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3},
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": True}},
    ]
    for body in chat:
        _error(http.post("/v1/chat/completions", json={"model": MODEL_NAME, **body}), 400)
    _error(http.get("/v1/completions"), 405)
    assert httpx.get(live.url + "/health", timeout=60).status_code == 200
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3).usage.completion_tokens <= 3


def test_chat_without_template_is_400(live, http):
    saved = live.tokenizer.chat_template
    live.tokenizer.chat_template = None
    try:
        err = _error(
            http.post(
                "/v1/chat/completions",
                json={"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            ),
            400,
        )
        assert "chat template" in err["message"]
    finally:
        live.tokenizer.chat_template = saved


def test_queue_full_is_429(live, client):
    live.async_llm.max_queue_len = 0  # nothing may wait: every new request is refused
    try:
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    finally:
        live.async_llm.max_queue_len = None
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2).choices[0].text is not None


# ---- load, disconnects, metrics -------------------------------------------------------------
def test_200_concurrent_streams_complete(live):
    async def one(c, i):
        stream = await c.completions.create(
            model=MODEL_NAME,
            prompt=f"x = {i}\n",
            max_tokens=4,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )
        chunks = [ch async for ch in stream]
        return chunks[-1].usage.completion_tokens, chunks[-2].choices[0].finish_reason

    async def run():
        async with openai.AsyncOpenAI(base_url=live.base_url, api_key=API_KEY, max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(200)))

    results = asyncio.run(run())
    assert results == [(4, "length")] * 200


async def _until(ok, what: str, timeout: float = 120.0) -> None:
    """Wait for ok() on the event loop; `timeout` bounds a hang, not a speed."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def _wait_idle(url: str, timeout: float = 60.0) -> list:
    """/metrics once nothing runs or waits and no KV block is in use; the last reading after
    `timeout` s (a bound for a leak, not a speed: the caller asserts)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        idle = (
            metric(samples, "pagedllm:num_requests_running") == 0
            and metric(samples, "pagedllm:num_requests_waiting") == 0
            and metric(samples, "pagedllm:kv_cache_usage_perc") == 0
        )
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def test_50_disconnects_after_first_chunk_free_everything(live):
    before = scrape(live.url)
    max_tokens = min(400, live.max_model_len - 32)

    async def one(c, i):
        stream = await c.completions.create(
            model=MODEL_NAME,
            prompt=f"y = {i} *",
            max_tokens=max_tokens,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            break
        await stream.close()

    async def run():
        async with openai.AsyncOpenAI(base_url=live.base_url, api_key=API_KEY, max_retries=0, timeout=120) as c:
            await asyncio.gather(*(one(c, i) for i in range(50)))

    asyncio.run(run())
    after = _wait_idle(live.url)
    assert metric(after, "pagedllm:num_requests_running") == 0
    assert metric(after, "pagedllm:kv_cache_usage_perc") == 0
    aborted = metric(after, "pagedllm:request_success_total", finished_reason="abort") - metric(
        before, "pagedllm:request_success_total", finished_reason="abort"
    )
    assert aborted == 50
    # the core stopped them: had it run them to the end (its abort lost) they would have made
    # 50 * max_tokens; how many it made before the aborts reached it depends on the scheduling
    generated = metric(after, "pagedllm:generation_tokens_total") - metric(before, "pagedllm:generation_tokens_total")
    assert generated < 50 * max_tokens
    m = live.async_llm.get_metrics()  # from the engine core process
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]


def test_disconnect_of_a_non_streamed_request_aborts_it(live):
    """The engine core is stopped (SIGSTOP) while the client posts and goes away, so the request
    cannot finish first whatever the scheduling; the server aborts it, then the core resumes."""
    before = scrape(live.url)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": min(400, live.max_model_len - 32), "ignore_eos": True}
    registry = live.async_llm.registry
    known = set(registry.by_request_id)

    async def post_and_leave():
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
            post = asyncio.ensure_future(c.post(live.base_url + "/completions", json=body))
            await _until(lambda: set(registry.by_request_id) - known, "the request never reached the engine")
            assert not post.done()
            post.cancel()  # the client goes away: its connection closes
            with contextlib.suppress(asyncio.CancelledError):
                await post
        await _until(lambda: not set(registry.by_request_id) - known, "the server never aborted the request")

    core = live.async_llm.core_pid
    os.kill(core, signal.SIGSTOP)
    try:
        asyncio.run(post_and_leave())
    finally:
        os.kill(core, signal.SIGCONT)
    after = _wait_idle(live.url)
    assert metric(after, "pagedllm:kv_cache_usage_perc") == 0
    aborted = metric(after, "pagedllm:request_success_total", finished_reason="abort") - metric(
        before, "pagedllm:request_success_total", finished_reason="abort"
    )
    assert aborted == 1


def test_metrics_exposition(live, client):
    client.completions.create(model=MODEL_NAME, prompt=PROMPT * 3, max_tokens=4, **GREEDY)
    client.completions.create(model=MODEL_NAME, prompt=PROMPT * 3, max_tokens=4, **GREEDY)  # prefix hit
    samples = fresh_scrape(live.url, live.async_llm)
    names = {n for n, _, _ in samples}
    for name in [
        "pagedllm:num_requests_running",
        "pagedllm:num_requests_waiting",
        "pagedllm:kv_cache_usage_perc",
        "pagedllm:prefix_cache_queries_total",
        "pagedllm:prefix_cache_hits_total",
        "pagedllm:num_preemptions_total",
        "pagedllm:prompt_tokens_total",
        "pagedllm:generation_tokens_total",
        "pagedllm:time_to_first_token_seconds_bucket",
        "pagedllm:time_per_output_token_seconds_bucket",
        "pagedllm:e2e_request_latency_seconds_bucket",
        "pagedllm:time_to_first_token_seconds_count",
    ]:
        assert name in names, name
    assert metric(samples, "pagedllm:prefix_cache_hits_total") > 0
    assert metric(samples, "pagedllm:generation_tokens_total") > 0
    assert metric(samples, "pagedllm:e2e_request_latency_seconds_count") >= 2
    assert all(lab.get("model_name") == MODEL_NAME for n, lab, _ in samples if n.startswith("pagedllm:"))


def test_raw_sse_format(http):
    with http.stream(
        "POST",
        "/v1/completions",
        json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "stream": True, "ignore_eos": True},
    ) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert all(p["object"] == "text_completion" and p["model"] == MODEL_NAME for p in payloads)
    assert len({p["id"] for p in payloads}) == 1
