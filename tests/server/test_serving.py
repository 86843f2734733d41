"""The serving layer without HTTP: OpenAIServing driven directly, with a thread-mode AsyncLLM
(answers, streams, the model's generation_config defaults) and with a fake engine (errors
mapped by their attributes, all prompts checked before any is queued), plus the app over
httpx's ASGI transport with that fake engine."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import httpx
import pytest

from pagedllm import SamplingParams
from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.entrypoints.openai.chat import parse_chat
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.parsing import parse_completion
from pagedllm.entrypoints.openai.routes import build_app
from pagedllm.entrypoints.openai.serving import OpenAIServing, SSEStream
from tests.server.helpers import CHAT_TEMPLATE

PROMPT = "def fibonacci(n):\n    "
MODEL_MAX_NEW_TOKENS = 5


@pytest.fixture(scope="module")
def greedy_model_dir(tiny_models, tmp_path_factory) -> str:
    """The tiny qwen3 (context 512) whose generation_config.json asks for greedy decoding and 5 new tokens."""
    d = tmp_path_factory.mktemp("greedy_model")
    for f in os.listdir(tiny_models["qwen3"]):
        shutil.copy(os.path.join(tiny_models["qwen3"], f), d / f)
    (d / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "top_p": 0.5, "max_new_tokens": MODEL_MAX_NEW_TOKENS})
    )
    return str(d)


@pytest.fixture(scope="module")
def serving(greedy_model_dir):
    """The engine on a thread of this process; its KV cache (256 tokens) is smaller than the context."""
    from pagedllm.entrypoints.async_llm import AsyncLLM

    async_llm = AsyncLLM(greedy_model_dir, engine_process=False, device="cpu", num_kv_blocks=32, block_size=8)
    async_llm.tokenizer.chat_template = CHAT_TEMPLATE
    yield OpenAIServing(async_llm, "tiny")
    async_llm.shutdown()


async def _collect(stream: SSEStream) -> list[str]:
    try:
        return [e async for e in stream.events]
    finally:
        stream.close()


def test_completion_without_sampling_fields_uses_the_models_generation_config(serving):
    async def run():
        engine = serving.engine
        reference = SamplingParams(temperature=0, max_tokens=MODEL_MAX_NEW_TOKENS, ignore_eos=True)
        ref = [o async for o in engine.generate(PROMPT, reference, "ref", stream=False)][-1]
        answer = await serving.create_completion({"prompt": PROMPT, "ignore_eos": True})
        return ref, answer

    ref, answer = asyncio.run(run())
    choice = answer["choices"][0]
    assert choice["text"] == ref.outputs[0].text and choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == MODEL_MAX_NEW_TOKENS
    assert answer["object"] == "text_completion" and answer["model"] == "tiny"

    # the SamplingParams behind it: the model fills what the body leaves unset, the body wins
    params = serving.sampling_params(parse_completion({"prompt": "x"}, "tiny"))
    assert (params.temperature, params.top_p, params.max_tokens) == (0.0, 0.5, MODEL_MAX_NEW_TOKENS)
    params = serving.sampling_params(parse_completion({"prompt": "x", "temperature": 1.0, "max_tokens": 9}, "tiny"))
    assert (params.temperature, params.top_p, params.max_tokens) == (1.0, 0.5, 9)


def test_chat_max_tokens_defaults_to_the_room_capped_by_the_model(serving):
    parsed = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, ["tiny"], serving.engine.tokenizer).parsed
    assert serving.sampling_params(parsed, room=3).max_tokens == 3
    assert serving.sampling_params(parsed, room=400).max_tokens == MODEL_MAX_NEW_TOKENS
    answer = asyncio.run(serving.create_chat_completion({"messages": [{"role": "user", "content": "hi"}]}))
    assert answer["object"] == "chat.completion"
    assert answer["usage"]["completion_tokens"] <= MODEL_MAX_NEW_TOKENS


def test_streamed_completion_events_without_http(serving):
    body = {"prompt": [PROMPT, "import os\n"], "max_tokens": 4, "ignore_eos": True}

    async def run():
        full = await serving.create_completion(body)
        stream = await serving.create_completion({**body, "stream": True, "stream_options": {"include_usage": True}})
        assert isinstance(stream, SSEStream)
        return full, await _collect(stream)

    full, events = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n" and all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    for i in (0, 1):
        text = "".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"][0]["index"] == i)
        assert text == full["choices"][i]["text"]
    assert full["usage"]["completion_tokens"] == 8


def test_errors_without_http(serving):
    async def refused(body, chat=False):
        with pytest.raises(APIError) as e:
            await (serving.create_chat_completion if chat else serving.create_completion)(body)
        return e.value.status, e.value.param, e.value.code

    hi = [{"role": "user", "content": "hi"}]
    assert asyncio.run(refused({"prompt": PROMPT, "temperature": -1})) == (400, "temperature", None)
    assert asyncio.run(refused({"prompt": [10**6]})) == (400, "prompt", None)
    assert asyncio.run(refused({"prompt": [1] * 600})) == (400, "prompt", "context_length_exceeded")
    assert asyncio.run(refused({"prompt": [1], "max_tokens": 600})) == (400, "max_tokens", "context_length_exceeded")
    assert asyncio.run(refused({"messages": hi, "max_completion_tokens": 600}, chat=True)) == (
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    )
    assert asyncio.run(refused({"model": "other", "prompt": "x"})) == (404, "model", "model_not_found")


# ---- a fake engine: the errors are whatever the test makes the input processor raise ----------
class _Tokenizer:
    chat_template = "{{ messages }}"
    added_tokens_decoder: dict = {}  # no special tokens

    def apply_chat_template(self, conversation, add_generation_prompt, tokenize):
        return "chat prompt"

    def encode(self, text, add_special_tokens=False):
        return [1, 2, 3]


class _Processor(InputProcessor):
    """The real input processor that also raises `error` for the prompt `[13]`."""

    def __init__(self, error: InvalidRequestError):
        super().__init__(_Tokenizer(), vocab_size=100, max_model_len=64, block_size=8, num_kv_blocks=4)
        self.error = error

    def tokenize(self, prompt, add_special_tokens=False):
        if prompt == [13] or (isinstance(prompt, dict) and prompt.get("prompt") == "chat prompt"):
            raise self.error  # a completion's ids [13], or the chat prompt (text and ids from the template)
        return super().tokenize(prompt, add_special_tokens)


class _Stream:
    def __init__(self, request):
        self.outputs = [
            RequestOutput(
                request.request_id,
                request.prompt,
                request.prompt_token_ids,
                [CompletionOutput(0, "ok", [7], "length", None, delta_text="ok", delta_token_ids=[7])],
                True,
            )
        ]

    async def __aiter__(self):
        for out in self.outputs:
            yield out

    def close(self) -> None:
        pass


class FakeEngine:
    """The part of AsyncLLM's public API the server uses; records what it is asked to queue."""

    def __init__(self, error: InvalidRequestError):
        self.generation_defaults: dict = {}
        self.timeline = None  # no PAGEDLLM_TIMELINE
        self.input_processor = _Processor(error)
        self.tokenizer = self.input_processor.tokenizer
        self.model_path = "/models/fake"
        self.max_model_len, self.num_kv_blocks, self.block_size = 64, 4, 8
        self.is_running, self.is_dead = True, False
        self.finish_callbacks: list = []
        self.queued: list = []

    def add_request(self, request, params=None, request_id=None, *, stream=True):
        self.queued.append(request)
        return _Stream(request)

    def get_metrics(self) -> dict:
        return {}


ODD = InvalidRequestError("the engine says no", "prompt", "some_reason")  # names no field in its text


def test_all_prompts_are_checked_before_any_is_queued():
    engine = FakeEngine(ODD)
    serving = OpenAIServing(engine, "fake")
    with pytest.raises(APIError) as e:
        asyncio.run(serving.create_completion({"prompt": [[1, 2], [1, 500]]}))
    assert (e.value.param, engine.queued) == ("prompt", [])
    answer = asyncio.run(serving.create_completion({"prompt": [[1, 2], [3]]}))
    assert [r.prompt_token_ids for r in engine.queued] == [[1, 2], [3]]
    assert [c["text"] for c in answer["choices"]] == ["ok", "ok"] and answer["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize(
    "error, path, body, param",
    [
        (ODD, "/v1/completions", {"prompt": [13]}, "prompt"),
        (ODD, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        (
            InvalidRequestError("too big", "max_tokens", "some_reason"),
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3},
            "max_completion_tokens",
        ),
        (
            InvalidRequestError("too big", "max_tokens", "some_reason"),
            "/v1/completions",
            {"prompt": [13]},
            "max_tokens",
        ),
        (InvalidRequestError("bad", "some_field", "some_reason"), "/v1/completions", {"prompt": [13]}, "some_field"),
    ],
)
def test_errors_reach_the_http_client_by_their_attributes(error, path, body, param):
    async def post():
        app = build_app(FakeEngine(error), "fake")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.post(path, json=body)

    resp = asyncio.run(post())
    assert resp.status_code == 400
    assert resp.json()["error"] == {
        "message": error.message,
        "type": "invalid_request_error",
        "param": param,
        "code": "some_reason",
    }
