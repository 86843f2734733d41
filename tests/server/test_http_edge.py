"""The HTTP edge, through the real HTTP API of `build_app` with an injected engine (a real
tokenizer and InputProcessor, requests answered at once): what a POST must look like (JSON
content type, a loopback Host when the server is bound to loopback, a body under the limit),
500s that say nothing internal, /v1/models without the model's path, idle sockets closed,
a client gone mid-body that is no server error, and tokenizing that never stalls /health."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest

from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.entrypoints.async_llm import EngineStepError
from pagedllm.entrypoints.openai.routes import build_app
from tests.server.helpers import CHAT_TEMPLATE, LiveServer

SECRET = "/srv/secret/models/internal-name"  # must never reach a client
BOOM = "the tokenizer raises on this prompt"
STEP_FAILS = "the engine fails on this prompt"
HOLD = "the tokenizer holds this prompt until the test releases it"
MODEL = "fake"
COMPLETION = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 1}


class _Tokenizer:
    """The tiny model's tokenizer, raising an internal error (with a path in its text) on BOOM;
    a prompt that starts with HOLD sets `holding` and waits for `release` before it is tokenized."""

    def __init__(self, real):
        self.real = real
        self.chat_template = CHAT_TEMPLATE
        self.added_tokens_decoder = real.added_tokens_decoder  # chat_utils.ChatTokenizer
        self.holding, self.release = threading.Event(), threading.Event()

    def encode(self, text, add_special_tokens=False, **kwargs):
        if text == BOOM:
            raise RuntimeError(f"cannot open {SECRET}/tokenizer.json")
        if text.startswith(HOLD):
            self.holding.set()
            assert self.release.wait(120), "the test never released the tokenizer"
        return self.real.encode(text, add_special_tokens=add_special_tokens, **kwargs)

    def apply_chat_template(self, conversation, **kwargs):
        return self.real.apply_chat_template(conversation, chat_template=CHAT_TEMPLATE, **kwargs)


class _Stream:
    def __init__(self, request, error=None):
        self.request, self.error = request, error

    async def __aiter__(self):
        if self.error is not None:
            raise self.error
        r = self.request
        yield RequestOutput(
            r.request_id, r.prompt, r.prompt_token_ids, [CompletionOutput(0, "ok", [7], "length")], True
        )

    def close(self) -> None:
        pass


class FakeEngine:
    """The part of AsyncLLM the server uses (serving.EngineClient); 64-token context."""

    def __init__(self, tokenizer):
        self.tokenizer = _Tokenizer(tokenizer)
        self.generation_defaults: dict = {}
        self.timeline = None  # no PAGEDLLM_TIMELINE
        self.max_model_len, self.num_kv_blocks, self.block_size = 64, 8, 16
        self.input_processor = InputProcessor(self.tokenizer, len(tokenizer), 64, 16, 8)
        self.model_path = SECRET
        self.is_running, self.is_dead = True, False
        self.finish_callbacks: list = []

    def add_request(self, request, params=None, request_id=None, *, stream=True):
        error = (
            EngineStepError(f"engine step failed: OverflowError('{SECRET}')") if request.prompt == STEP_FAILS else None
        )
        return _Stream(request, error)

    def get_metrics(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def engine(tiny_models):
    from pagedllm.entrypoints.model_dir import load_tokenizer

    return FakeEngine(load_tokenizer(tiny_models["qwen3"]))


def call(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# ---- what a request must look like ----------------------------------------------------------
@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/xml",
        "text/xml",
        None,
    ],
)
def test_post_bodies_that_are_not_declared_json_are_415(engine, content_type):
    """Browsers send these cross-origin without a preflight; the body itself is valid JSON."""
    app = build_app(engine, MODEL)
    headers = {} if content_type is None else {"Content-Type": content_type}
    for path in ("/v1/completions", "/v1/chat/completions"):
        err = error_of(call(app, "POST", path, content=json.dumps(COMPLETION).encode(), headers=headers), 415)
        assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]


def test_json_with_parameters_is_accepted(engine):
    app = build_app(engine, MODEL)
    for ct in ("application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"):
        resp = call(
            app, "POST", "/v1/completions", content=json.dumps(COMPLETION).encode(), headers={"Content-Type": ct}
        )
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "ok"


def test_a_foreign_host_is_421_when_only_loopback_is_allowed(engine):
    loopback_only = build_app(engine, MODEL, allowed_hosts=())
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil.example", "[::2]"):
        for method, path in (("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models")):
            err = error_of(call(loopback_only, method, path, headers={"Host": host}), 421)
            assert err["code"] == "invalid_host"
        err = error_of(call(loopback_only, "POST", "/v1/completions", json=COMPLETION, headers={"Host": host}), 421)
    for host in ("localhost", "LOCALHOST:8000", "127.0.0.1", "127.0.0.1:1234", "127.3.2.1", "[::1]", "[::1]:8000"):
        assert call(loopback_only, "GET", "/health", headers={"Host": host}).status_code == 200, host
        assert (
            call(loopback_only, "POST", "/v1/completions", json=COMPLETION, headers={"Host": host}).status_code == 200
        )
    extra = build_app(engine, MODEL, allowed_hosts=["gpu-box.lan"])
    assert call(extra, "GET", "/health", headers={"Host": "GPU-box.lan:8000"}).status_code == 200
    assert call(extra, "GET", "/health", headers={"Host": "localhost:8000"}).status_code == 200
    assert call(extra, "GET", "/health", headers={"Host": "evil.example"}).status_code == 421
    anyone = build_app(engine, MODEL)  # not bound to loopback: no Host check
    assert call(anyone, "GET", "/health", headers={"Host": "evil.example"}).status_code == 200


def test_a_body_over_the_limit_is_413_by_length_and_while_chunked(engine):
    limit = 64 << 10
    app = build_app(engine, MODEL, max_request_body_size=limit)
    body = json.dumps({**COMPLETION, "prompt": "x" * limit}).encode()
    resp = call(app, "POST", "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    err = error_of(resp, 413)
    assert err["code"] == "request_too_large" and str(limit) in err["message"]
    assert resp.headers["connection"] == "close"

    async def chunks():  # no Content-Length: Transfer-Encoding chunked
        for _ in range(64):
            yield b" " * 4096
        yield body

    resp = call(app, "POST", "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert error_of(resp, 413)["code"] == "request_too_large"
    assert "content-length" not in resp.request.headers
    # exactly at the limit the body is read and parsed
    at_limit = json.dumps(COMPLETION).encode().ljust(limit)
    resp = call(app, "POST", "/v1/completions", content=at_limit, headers={"Content-Type": "application/json"})
    assert resp.status_code == 200


# ---- what an answer may say ----------------------------------------------------------------
def test_500s_carry_a_request_id_and_nothing_internal(engine, caplog):
    app = build_app(engine, MODEL)
    with caplog.at_level(logging.ERROR, logger="pagedllm"):
        resp = call(app, "POST", "/v1/completions", json={**COMPLETION, "prompt": BOOM})
    err = error_of(resp, 500)
    assert err["type"] == "internal_server_error"
    assert SECRET not in resp.text and "RuntimeError" not in resp.text and "Traceback" not in resp.text
    rid = err["message"].split("request id ")[1].split(")")[0]
    logged = [r for r in caplog.records if r.exc_info]
    assert len(logged) == 1 and rid in logged[0].getMessage()  # the traceback, once, under the id

    resp = call(app, "POST", "/v1/completions", json={**COMPLETION, "prompt": STEP_FAILS})
    err = error_of(resp, 500)
    assert SECRET not in resp.text and "Overflow" not in resp.text and "request id cmpl-" in err["message"]
    resp = call(app, "POST", "/v1/completions", json={**COMPLETION, "prompt": STEP_FAILS, "stream": True})
    assert resp.status_code == 200 and SECRET not in resp.text and "Overflow" not in resp.text
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "internal_server_error"


def test_models_do_not_disclose_the_model_directory(engine):
    app = build_app(engine, MODEL)
    listed = call(app, "GET", "/v1/models")
    one = call(app, "GET", f"/v1/models/{MODEL}")
    for resp in (listed, one):
        assert resp.status_code == 200 and "secret" not in resp.text
    assert listed.json()["data"][0]["root"] == MODEL == one.json()["root"]


# ---- sockets -------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["auto", "h11"])  # httptools (installed by the test extra), h11
def live_fake(engine, request):
    srv = LiveServer(build_app(engine, MODEL, allowed_hosts=()), http=request.param, timeout_keep_alive=1).start()
    protocol = srv.server.config.http.__name__  # the parser that this run exercises
    assert protocol == ("H11WithHeadDeadline" if request.param == "h11" else "HttpToolsWithHeadDeadline")
    yield srv
    srv.stop()


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_idle_sockets_are_closed_and_a_request_is_served_meanwhile(live_fake):
    idle = [socket.create_connection(("127.0.0.1", live_fake.port)) for _ in range(250)]
    slow = socket.create_connection(("127.0.0.1", live_fake.port))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")  # a head that never ends
    try:
        resp = httpx.post(live_fake.base_url + "/completions", json=COMPLETION, timeout=60)
        assert resp.status_code == 200
        for s in [*idle, slow]:
            s.setblocking(False)
        open_ = [*idle, slow]
        # the server closes them after its 1-s keep-alive; a server without the head deadline never
        # closes them (the slow one gets a byte every 0.1 s), so a bound for a hang suffices
        deadline = time.monotonic() + 60
        while open_:
            time.sleep(0.1)
            slow_alive = slow in open_
            if slow_alive:
                slow.send(b"X")  # trickling bytes does not extend the deadline
            open_ = [s for s in open_ if not _closed_by_peer(s)]
            assert time.monotonic() < deadline, f"{len(open_)} idle sockets still open"
    finally:
        for s in [*idle, slow]:
            s.close()
    with httpx.Client(base_url=live_fake.base_url, timeout=10) as c:  # a kept-alive client within the timeout
        assert [c.post("/completions", json=COMPLETION).status_code for _ in range(3)] == [200] * 3


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_a_client_gone_mid_body_is_one_debug_line(live_fake):
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("pagedllm", "uvicorn.error", "uvicorn")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
    logging.getLogger("pagedllm").setLevel(logging.DEBUG)
    try:
        s = socket.create_connection(("127.0.0.1", live_fake.port))
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "'
        )
        time.sleep(0.2)
        s.close()
        deadline = time.monotonic() + 60  # a bound for a hang, not a speed
        while not handler.records and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # anything logged after the first line
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
    assert [(r.levelno, r.exc_info) for r in handler.records] == [(logging.DEBUG, None)], [
        r.getMessage() for r in handler.records
    ]
    assert "disconnected" in handler.records[0].getMessage()
    assert httpx.post(live_fake.base_url + "/completions", json=COMPLETION, timeout=10).status_code == 200


LONG_PROMPT = HOLD + "\ndef f(x):\n    return x * 2 + 1  # comment\n" * 200  # a body past INLINE_BODY_BYTES


@pytest.mark.parametrize(
    "body, status",
    [
        # a long body is prepared on a worker thread (then refused: the fake engine's context is 64 tokens)
        ({**COMPLETION, "prompt": LONG_PROMPT}, 400),
        # so is a short one that asks for a grammar, whose compiling does not scale with the body's size
        ({**COMPLETION, "prompt": HOLD, "response_format": {"type": "json_object"}}, 200),
        # and one with bad words, each tokenized (here the held one)
        ({**COMPLETION, "bad_words": [HOLD]}, 200),
    ],
    ids=["long-prompt", "short-with-grammar", "short-with-bad-words"],
)
def test_health_answers_while_a_prompt_is_tokenized(live_fake, engine, body, status):
    """Tokenizing a long body (or one with a grammar) runs on a worker thread, not on the event
    loop: /health answers while its tokenizing is held (the tokenizer waits until the test has its
    answers). Small bodies are prepared on the loop (serving.py: prepared_on_loop)."""
    from pagedllm.entrypoints.openai.serving import INLINE_BODY_BYTES

    assert (len(json.dumps(body)) > INLINE_BODY_BYTES) == (status == 400)
    tokenizer = engine.tokenizer
    tokenizer.holding.clear()
    tokenizer.release.clear()
    result: dict = {}

    def held():
        r = httpx.post(live_fake.base_url + "/completions", json=body, timeout=180)
        result.update(status=r.status_code, body=r.json())

    worker = threading.Thread(target=held)
    worker.start()
    try:
        assert tokenizer.holding.wait(60), "the prompt never reached the tokenizer"
        with httpx.Client(timeout=60) as c:  # a loop blocked in the tokenizer would never answer
            assert [c.get(live_fake.url + "/health").status_code for _ in range(3)] == [200] * 3
    finally:
        tokenizer.release.set()
        worker.join(120)
    assert not worker.is_alive()
    assert result["status"] == status, result  # then it was tokenized
    if status == 400:
        assert result["body"]["error"]["code"] == "context_length_exceeded"
