"""Structured output through the openai client against a live thread-mode server on the bundled
model: 50 seeded samples per mode (one request with n=50: sample i draws with seed + i), each of
which must parse and validate; streamed with n=3; and under a KV pool small enough to preempt."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.server.helpers import API_KEY, MODEL_NAME, LiveServer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "kind": {"enum": ["module", "class", "function"]},
        "size": {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["n"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "size", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}_[0-9]{1,3}"
CHOICES = ["import", "def", "class"]
GRAMMAR = 'start: "x" NUM | "x" NUM "+" NUM | "x" NUM "+" NUM "+" NUM\nNUM: /[0-9]{1,2}/'  # Lark (llguidance's)
CALL = re.compile(r"x[0-9]{1,2}(\+[0-9]{1,2}){0,2}")


def _valid_json_object(text: str) -> bool:
    return isinstance(json.loads(text), dict)


MODES = {
    "json_schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}},
        lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
    ),  # fmt: skip
    "regex": ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    "grammar": ({"guided_grammar": GRAMMAR}, lambda t: CALL.fullmatch(t) is not None),
}


@pytest.fixture(scope="module")
def client(server_model):
    import openai

    from pagedllm.entrypoints.async_llm import AsyncLLM
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.entrypoints.openai.routes import build_app

    # 40 blocks of 16 tokens for up to 150 sequences: the n=50 requests preempt each other
    async_llm = AsyncLLM(llm=LLM(server_model, device="cpu", num_kv_blocks=40, max_num_seqs=150, max_model_len=512))
    live = LiveServer(build_app(async_llm, MODEL_NAME, API_KEY)).start()
    with openai.OpenAI(base_url=live.base_url, api_key=API_KEY, max_retries=0, timeout=120) as c:
        c.live = live  # type: ignore[attr-defined]  (the raw-HTTP tests below)
        yield c, async_llm
    live.stop()
    async_llm.shutdown()


@pytest.mark.slow  # 16 s on 2 cores: run after the README command (.ci/run)
def test_50_seeded_samples_per_mode_all_valid(client):
    c, async_llm = client
    for name, (fields, valid) in MODES.items():
        r = c.completions.create(
            model=MODEL_NAME, prompt="x = ", n=50, seed=7, temperature=1.0, max_tokens=48, extra_body=fields
        )
        bad = [ch.text for ch in r.choices if ch.finish_reason != "stop" or not valid(ch.text)]
        assert not bad, (name, bad[:3])
    r = c.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "a JSON object"}],
        n=50,
        seed=3,
        temperature=1.0,
        max_tokens=80,
        response_format={"type": "json_object"},
    )
    # any JSON object: its strings are unbounded, so some samples may run out of tokens
    done = [ch.message.content for ch in r.choices if ch.finish_reason == "stop"]
    assert len(done) >= 10 and all(_valid_json_object(t) for t in done)


def test_streamed_n3_and_preempted(client):
    """The stream runs beside an n=50 request of its own (whichever xdist worker runs this test,
    the other tests may run elsewhere): 53 sequences in a 40-block pool preempt each other."""
    import threading

    c, async_llm = client
    before = async_llm.llm.get_metrics()["num_preemptions"]
    fields, valid = MODES["json_schema"]
    crowd = threading.Thread(
        target=lambda: c.completions.create(
            model=MODEL_NAME, prompt="x = ", n=50, seed=5, temperature=1.0, max_tokens=48, extra_body=fields
        )
    )
    crowd.start()
    texts = ["", "", ""]
    for chunk in c.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "describe a module"}],
        n=3,
        seed=11,
        temperature=1.0,
        max_tokens=80,
        stream=True,
        extra_body=fields,
    ):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    crowd.join()
    assert all(valid(t) for t in texts), texts
    assert async_llm.llm.get_metrics()["num_preemptions"] > before


def test_grammar_that_fails_over_the_tokenizer_is_a_400_before_queueing(client):
    """`<[99999]>` reads as a grammar alone, but the model's tokenizer has 8,192 ids: the edge
    compiles each grammar over the real tokenizer (issue 36), so this is a 400 naming the cause."""
    import openai

    c, async_llm = client
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=4, extra_body={"guided_grammar": "start: <[99999]>"}
        )
    assert "99999" in str(e.value) and "tokenizer" in str(e.value), str(e.value)
    assert not async_llm.llm.engine.has_unfinished_requests()


def test_a_grammar_the_core_cannot_compile_is_a_500_naming_it_streamed_or_not(client, monkeypatch):
    """When only the core finds the grammar broken (here: the edge's tokenizer check switched off),
    the client gets a 500 with llguidance's message, or an error event then [DONE] on a stream,
    never finish_reason "abort" with empty text; other requests carry on."""
    import httpx
    import openai

    from pagedllm.engine.grammar import GrammarChecker

    c, async_llm = client
    monkeypatch.setattr(async_llm.input_processor, "grammars", GrammarChecker(None))  # the syntax check only
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 4, "guided_grammar": "start: <[99999]>"}
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=4, extra_body={"guided_grammar": "start: <[99999]>"}
        )
    assert "cannot be compiled" in str(e.value) and "99999" in str(e.value), str(e.value)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(c.live.base_url + "/completions", json={**body, "stream": True}, headers=headers, timeout=120)
    events = [ln[len("data: ") :] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    err = json.loads(events[-2])["error"]
    assert err["code"] == "grammar_compile_failed" and "99999" in err["message"], err
    ok = c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, extra_body={"guided_choice": ["yes", "no"]})
    assert ok.choices[0].text in ("yes", "no")


def test_a_schema_without_additional_properties_gets_no_unlisted_key(client):
    """response_format and guided_json read an object schema without additionalProperties as
    `false` (vLLM's xgrammar and OpenAI's strict mode do): no sample writes a key it does not list,
    however many keys the model would like to add; an explicit `true` is honoured."""
    c, _ = client
    listed = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": listed}}
    r = c.completions.create(
        model=MODEL_NAME,
        prompt="x = ",
        n=20,
        seed=13,
        temperature=1.0,
        max_tokens=48,
        extra_body={"response_format": fmt},
    )
    objs = [json.loads(ch.text) for ch in r.choices if ch.finish_reason == "stop"]
    assert len(objs) == 20 and all(set(o) <= {"n"} for o in objs), [ch.text for ch in r.choices][:3]
    r = c.completions.create(
        model=MODEL_NAME, prompt="x = ", n=20, seed=13, temperature=1.0, max_tokens=48,
        extra_body={"guided_json": {"type": "object", "properties": {}}},
    )  # fmt: skip
    assert [ch.text for ch in r.choices] == ["{}"] * 20
    r = c.completions.create(
        model=MODEL_NAME, prompt="x = ", n=20, seed=13, temperature=1.0, max_tokens=48,
        extra_body={"guided_json": {"type": "object", "properties": {}, "additionalProperties": True}},
    )  # fmt: skip
    assert any(ch.text != "{}" for ch in r.choices)  # open: the model does write keys
