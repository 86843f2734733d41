"""Tool calls on /v1/chat/completions: tools through a Hermes/Qwen-style template given per
request, tool_choice's rules, the Hermes reader (whole and streamed), the answers' shapes, and
"required" / named functions enforced by structured output through the openai client and
LangChain against a live thread-mode server on the bundled model."""

from __future__ import annotations

import json
import socket

import jsonschema
import pytest

from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.entrypoints.openai.chat import parse_chat
from pagedllm.entrypoints.openai.responses import ChatResponses
from pagedllm.entrypoints.openai.tool_parsers import HermesToolCalls, RequiredToolCalls
from tests.server.helpers import API_KEY, MODEL_NAME, LiveServer

# Qwen2.5's way of offering tools and writing calls, cut down
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments.city }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city <|im_end|>",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}
HI = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(server_model):
    """A server that reads "auto" answers with the Hermes parser and trusts request templates."""
    from pagedllm.entrypoints.async_llm import AsyncLLM
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.entrypoints.openai.routes import build_app

    async_llm = AsyncLLM(llm=LLM(server_model, device="cpu", num_kv_blocks=64, max_model_len=1024))
    live = LiveServer(
        build_app(async_llm, MODEL_NAME, API_KEY, tool_parser="hermes", trust_request_chat_template=True)
    ).start()
    live.tokenizer = async_llm.tokenizer
    yield live
    live.stop()
    async_llm.shutdown()


@pytest.fixture(scope="module")
def http(srv):
    import httpx

    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(srv):
    import openai

    with openai.OpenAI(base_url=srv.base_url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def no_network(monkeypatch):
    """Only loopback connections (LangChain must not fetch tiktoken's encodings)."""
    connect = socket.socket.connect

    def loopback_only(self, address):
        if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"a test tried to reach {address}")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)


def via_client(**kw):
    """openai client arguments: the template travels in extra_body."""
    return {
        "model": MODEL_NAME,
        "messages": HI,
        "max_tokens": 40,
        "extra_body": {"chat_template": TOOLS_TEMPLATE},
        **kw,
    }


def body(**kw):
    return {"model": MODEL_NAME, "messages": HI, "chat_template": TOOLS_TEMPLATE, "max_tokens": 8, **kw}


def test_tools_and_tool_messages_reach_the_template_and_stay_text(srv):
    messages = [
        *HI,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    prompt = parse_chat(
        body(messages=messages, tools=[WEATHER], tool_choice="none"),
        [MODEL_NAME],
        srv.tokenizer,
        trust_request_chat_template=True,
    ).parsed.prompts[0]
    assert '"name": "get_weather"' in prompt["prompt"]  # the tool, as tojson wrote it
    assert "<tool_call>get_weather Oslo</tool_call>" in prompt["prompt"]  # arguments parsed to an object
    assert "<|im_start|>tool\nsunny" in prompt["prompt"]
    end = srv.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert prompt["prompt_token_ids"].count(end) == 4  # the template's four; the description's is text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [WEATHER]}, "tool_choice"),  # "auto" by default: fine here, refused without a parser below
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt
        ({"documents": ["x"]}, "documents"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
        (
            {
                "messages": [
                    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_tool_field_mistakes_are_400_naming_the_field(srv, http, extra, param):
    r = http.post("/v1/chat/completions", json=body(**extra))
    if extra == {"tools": [WEATHER]}:  # this server has a parser: "auto" runs
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_auto_needs_a_parser_and_request_templates_need_trust(live, http_default):
    r = http_default.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": HI, "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = http_default.post("/v1/chat/completions", json=body())
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    r = http_default.post(
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": HI, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 2},
    )
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]


@pytest.fixture(scope="module")
def http_default(live):
    import httpx

    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


ANSWER = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def test_hermes_reader_whole_and_streamed_agree():
    content, calls = HermesToolCalls().extract(ANSWER)
    assert content == "Let me check. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("get_time", {}),
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert HermesToolCalls().extract("no call here") == ("no call here", [])
    assert HermesToolCalls().extract("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert len(HermesToolCalls(max_calls=1).extract(ANSWER)[1]) == 1
    for size in (1, 3, 7, len(ANSWER)):
        s = HermesToolCalls().streamer()
        pieces = [ANSWER[i : i + size] for i in range(0, len(ANSWER), size)]
        deltas = [d for k, p in enumerate(pieces) for d in s.feed(p, k == len(pieces) - 1)]
        text = "".join(d.get("content", "") for d in deltas)
        args: dict[int, str] = {}
        heads = []
        for d in deltas:
            for tc in d.get("tool_calls", []):
                if "id" in tc:
                    heads.append((tc["index"], tc["function"]["name"]))
                args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
        assert text == "Let me check. " and heads == [(0, "get_weather"), (1, "get_time")] and s.called
        assert [json.loads(a) for a in args.values()] == [{"city": "Paris", "unit": "c"}, {}]
    held = HermesToolCalls().streamer()
    assert held.feed("hi <tool_", False) == [{"content": "hi "}]  # a possible tag is held back
    assert held.feed("x", True) == [{"content": "<tool_x"}]


def _outs(text: str, finish: str | None) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, text, [1], finish, delta_text=text)], finish is not None)


def test_chat_answers_carry_tool_calls_and_finish_reason_tool_calls():
    final = ChatResponses("r", 0, "m", tool_reader=HermesToolCalls()).final([_outs(ANSWER, "stop")], [1])
    choice = final["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check. "
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "get_time"]
    plain = ChatResponses("r", 0, "m", tool_reader=HermesToolCalls()).final([_outs("hello", "stop")], [1])
    assert plain["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in plain["choices"][0]["message"]
    b = ChatResponses("r", 0, "m", tool_reader=HermesToolCalls())
    events = b.events(0, _outs(ANSWER[:30], None)) + b.events(0, _outs(ANSWER[30:], "stop"))
    chunks = [json.loads(e[len("data: ") :]) for e in events]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[0]["choices"][0]["delta"] == {"content": "Let me check. "}
    assert RequiredToolCalls().extract('[{"name": "get_time", "parameters": {}}]')[1][0]["function"] == {
        "name": "get_time",
        "arguments": "{}",
    }


# ---- enforced with structured output (engine/structured_output.py) -----------------------------
def _valid(call, tool=WEATHER):
    assert call.type == "function" and call.function.name == tool["function"]["name"] and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_required_and_named_are_enforced(client):
    for seed in range(3):
        r = client.chat.completions.create(
            **via_client(
                tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, seed=seed, max_tokens=60
            )
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        call = choice.message.tool_calls[0]
        _valid(call, WEATHER if call.function.name == "get_weather" else TIME)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(**via_client(tools=[WEATHER, TIME], tool_choice=named, max_tokens=60))
    assert r.choices[0].message.content is None
    _valid(r.choices[0].message.tool_calls[0])
    # streamed: a head with the id and name, then argument fragments
    parts = list(
        client.chat.completions.create(**via_client(tools=[WEATHER], tool_choice=named, max_tokens=60, stream=True))
    )
    calls = [tc for p in parts for c in p.choices for tc in (c.delta.tool_calls or [])]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    args = "".join(tc.function.arguments or "" for tc in calls)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])


def test_langchain_bind_tools_and_structured_output(srv, no_network):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=12)
        unit: str = Field(pattern="^[cf]$")

    llm = ChatOpenAI(
        base_url=srv.base_url,
        api_key=API_KEY,
        model=MODEL_NAME,
        max_tokens=60,
        max_retries=0,
        # seeded: unseeded, a sample now and then spent its 60 tokens inside a string and finished no call
        extra_body={"chat_template": TOOLS_TEMPLATE, "seed": 1},
    )
    for choice in ("required", "Weather"):
        msg = llm.bind_tools([Weather], tool_choice=choice).invoke("weather in Paris?")
        assert msg.tool_calls and msg.tool_calls[0]["name"] == "Weather", msg
        Weather(**msg.tool_calls[0]["args"])
    out = llm.with_structured_output(Weather, method="json_schema").invoke("weather in Paris?")
    assert isinstance(out, Weather)


def test_openai_parse_returns_the_model(client):
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=12)
        unit: str = Field(pattern="^[cf]$")

    r = client.chat.completions.parse(**via_client(max_tokens=60), response_format=Weather)
    assert isinstance(r.choices[0].message.parsed, Weather)
