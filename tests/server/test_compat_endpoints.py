"""vLLM's small endpoints and server switches on a live server (engine on a thread, bundled
model): /tokenize, /detokenize, /version, several served names, CORS, the per-request log line."""

from __future__ import annotations

import logging

import pytest

from tests.server.helpers import API_KEY, LiveServer

ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def compat():
    import httpx

    from pagedllm.entrypoints.async_llm import AsyncLLM
    from pagedllm.entrypoints.model_dir import bundled_model_path
    from pagedllm.entrypoints.openai.routes import build_app

    async_llm = AsyncLLM(bundled_model_path(), engine_process=False, device="cpu", num_kv_blocks=32, log_requests=True)
    app = build_app(async_llm, ["main", "alias"], API_KEY, allowed_origins=[ORIGIN])
    srv = LiveServer(app).start()
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        http.async_llm = async_llm  # type: ignore[attr-defined]
        yield http
    srv.stop()
    async_llm.shutdown()


def test_tokenize_and_detokenize_round_trip(compat):
    tok = compat.async_llm.tokenizer
    r = compat.post("/tokenize", json={"prompt": "def fibonacci(n):", "model": "alias", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("def fibonacci(n):") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == compat.async_llm.max_model_len
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    assert compat.post("/tokenize", json={"prompt": "x"}).json()["token_strs"] is None
    r = compat.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "def fibonacci(n):"}


def test_tokenize_messages_counts_the_chat_prompt(compat):
    from pagedllm.entrypoints.openai.chat import chat_prompt

    body = {"messages": [{"role": "user", "content": "hello"}]}
    want = chat_prompt(dict(body), compat.async_llm.tokenizer, "main")["prompt_token_ids"]
    r = compat.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == want and r.json()["count"] == len(want)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "chat_template_kwargs": {}}, "chat_template_kwargs"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True},
            "add_special_tokens",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": False},
            "add_generation_prompt",
        ),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
    ],
)
def test_bad_bodies_get_a_400_naming_the_field(compat, path, body, param):
    r = compat.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_version_and_the_served_names(compat):
    from pagedllm import __version__

    assert compat.get("/version").json() == {"version": __version__}
    assert [m["id"] for m in compat.get("/v1/models").json()["data"]] == ["main", "alias"]
    assert compat.post("/tokenize", json={"prompt": "a", "model": "other"}).status_code == 404


def test_cors_allows_the_listed_origin_only(compat):
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = compat.options("/v1/completions", headers={**preflight, "Authorization": ""})  # a preflight has no key
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = compat.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = compat.options("/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_each_request_is_logged_unless_disabled(compat, caplog):
    body = {"model": "alias", "prompt": "import ", "max_tokens": 2, "temperature": 0}
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        r = compat.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == "alias"
        lines = [m.getMessage() for m in caplog.records if m.getMessage().startswith("Received request")]
        assert len(lines) == 1 and r.json()["id"] in lines[0] and "prompt tokens:" in lines[0]
        assert "max_tokens=2" in lines[0]
        caplog.clear()
        compat.async_llm.log_requests = False
        try:
            assert compat.post("/v1/completions", json=body).status_code == 200
        finally:
            compat.async_llm.log_requests = True
        assert not [m for m in caplog.records if m.getMessage().startswith("Received request")]
