"""Beam search on /v1/completions and /v1/chat/completions: `use_beam_search` with `n` beams,
`length_penalty` and `early_stopping` (vLLM's extra parameters).

Two halves: OpenAIServing driven with a scripted engine that answers a beam-search request with
one hand-built final RequestOutput (what reaches SamplingParams, the answer's shape, every 400
naming its field, nothing queued for a refused request, a request in flight left alone), then
the live server through the official `openai` client on the bundled model (shapes, refusals,
and the beams' content equal to `LLM.beam_search` / `LLM.generate` on the same model)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from pagedllm import SamplingParams
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.engine.sampling_params import MAX_BEAM_WIDTH
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.routes import build_app
from pagedllm.entrypoints.openai.serving import OpenAIServing
from tests.server.helpers import MODEL_NAME
from tests.server.test_parallel_logprobs import CharTokenizer  # one token per character

# the model's generation_config.json, as the bundled model's (a sampling temperature and top_p)
MODEL_DEFAULTS = {"temperature": 0.7, "top_p": 0.95, "top_k": 20, "max_tokens": 9}
MAX_NUM_SEQS = 8


# ---- a scripted engine -------------------------------------------------------------------
def beam_text(prompt_ids: list[int], i: int) -> str:
    """Beam i of a prompt: its own letter i + 1 times, then the prompt's first character."""
    return chr(ord("A") + i) * (i + 1) + chr(prompt_ids[0])


class _Script:
    """A request's outputs: a beam-search request gets ONE final RequestOutput with its n beams,
    best first (as the engine sends it); any other one token per sample. `hold` (an Event)
    keeps the final output back until set."""

    def __init__(self, request, hold: asyncio.Event | None):
        p, ids = request.params, request.prompt_token_ids
        outs = []
        for i in range(p.n):
            text = beam_text(ids, i) if p.use_beam_search else "ok"
            toks = [ord(c) for c in text]
            outs.append(
                CompletionOutput(
                    i,
                    text,
                    toks,
                    "stop" if i % 2 else "length",
                    None,
                    cumulative_logprob=-1.0 - i if p.use_beam_search else None,
                    score=(-1.0 - i) / len(toks) ** p.length_penalty if p.use_beam_search else None,
                    delta_text=text,
                    delta_token_ids=toks,
                )
            )
        self.output = RequestOutput(request.request_id, request.prompt, ids, outs, True)
        self.hold, self.closed = hold, False

    async def __aiter__(self):
        if self.hold is not None:
            await self.hold.wait()
        yield self.output

    def close(self) -> None:
        self.closed = True


class ScriptedEngine:
    """What the server uses of AsyncLLM, with the bundled model's kind of sampling defaults; it
    records the requests it queues (their SamplingParams are what the test checks)."""

    def __init__(self, hold: asyncio.Event | None = None):
        self.generation_defaults = dict(MODEL_DEFAULTS)
        self.timeline = None  # no PAGEDLLM_TIMELINE
        self.tokenizer = CharTokenizer()
        self.input_processor = InputProcessor(self.tokenizer, 128, 64, 8, 64, max_num_seqs=MAX_NUM_SEQS)
        self.model_path = "/models/fake"
        self.max_model_len, self.num_kv_blocks, self.block_size = 64, 64, 8
        self.is_running, self.is_dead = True, False
        self.finish_callbacks: list = []
        self.queued: list = []
        self.streams: list[_Script] = []
        self.hold = hold

    def add_request(self, request, params=None, request_id=None, *, stream=True):
        self.queued.append(request)
        self.streams.append(_Script(request, self.hold))
        return self.streams[-1]

    def get_metrics(self) -> dict:
        return {}


BEAM = {"use_beam_search": True, "n": 4}
HI = [{"role": "user", "content": "hi"}]


def _answer(body: dict, chat: bool = False, engine: ScriptedEngine | None = None) -> dict:
    serving = OpenAIServing(engine or ScriptedEngine(), "fake")
    call = serving.create_chat_completion if chat else serving.create_completion
    return asyncio.run(call(body))


def _params(body: dict, chat: bool = False) -> SamplingParams:
    engine = ScriptedEngine()
    _answer(body, chat, engine)
    (request,) = engine.queued
    return request.params


# ---- what reaches SamplingParams ------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True])
def test_beam_fields_reach_sampling_params_without_the_models_sampling_defaults(chat):
    where = {"messages": HI, "max_completion_tokens": 5} if chat else {"prompt": "hi", "max_tokens": 5}
    body = {**where, **BEAM, "length_penalty": 0.5, "early_stopping": "never", "ignore_eos": True}
    p = _params(body, chat)
    assert (p.use_beam_search, p.n, p.length_penalty, p.early_stopping) == (True, 4, 0.5, "never")
    assert (p.max_tokens, p.ignore_eos) == (5, True)
    # greedy, and none of the model's sampling defaults (temperature 0.7, top_p 0.95, top_k 20)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.logprobs, p.best_of) == (
        0.0,
        1.0,
        -1,
        0.0,
        None,
        None,
        None,
    )
    p = _params({**where, "use_beam_search": True, "early_stopping": True}, chat)
    assert (p.n, p.length_penalty, p.early_stopping, p.temperature) == (1, 1.0, True, 0.0)


def test_beam_search_takes_the_default_max_tokens_like_any_request():
    """The token limit is not a sampling default: the model's max_new_tokens still applies (9),
    on chat capped by the room the prompt leaves."""
    assert _params({"prompt": "hi", **BEAM}).max_tokens == MODEL_DEFAULTS["max_tokens"]
    assert _params({"messages": HI, **BEAM}, chat=True).max_tokens == MODEL_DEFAULTS["max_tokens"]
    assert _params({"prompt": "x" * 60, **BEAM}).max_tokens == 4  # 64 - 60: the room left


def test_client_sent_values_that_beam_search_allows_are_accepted():
    body = {"prompt": "hi", **BEAM, "temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0, "best_of": 4}
    p = _params({**body, "stop": [], "stop_token_ids": [], "min_tokens": 0, "max_tokens": 3})
    assert (p.use_beam_search, p.n, p.best_of, p.temperature, p.max_tokens) == (True, 4, 4, 0.0, 3)
    assert _params({"messages": HI, **BEAM, "logprobs": False, "top_logprobs": 0}, chat=True).logprobs is None


def test_knobs_at_their_defaults_are_accepted_without_beam_search():
    p = _params({"prompt": "hi", "length_penalty": 1.0, "early_stopping": False, "use_beam_search": False})
    assert not p.use_beam_search
    assert (p.temperature, p.top_p, p.top_k) == (0.7, 0.95, 20)  # an ordinary request keeps the model's defaults


# ---- the answer's shape ---------------------------------------------------------------------
def test_completion_beams_are_the_choices_best_first():
    answer = _answer({"prompt": "hi", **BEAM, "max_tokens": 5})
    ids = [ord("h"), ord("i")]
    assert answer["object"] == "text_completion"
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in answer["choices"]] == [beam_text(ids, i) for i in range(4)]
    assert [c["finish_reason"] for c in answer["choices"]] == ["length", "stop", "length", "stop"]
    assert all(c["logprobs"] is None and c["stop_reason"] is None for c in answer["choices"])
    # the prompt once; every returned beam's tokens (2 + 3 + 4 + 5)
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 14, "total_tokens": 16}


def test_completion_batch_numbers_each_prompts_beams():
    answer = _answer({"prompt": ["hi", "yo!"], **BEAM, "n": 2, "max_tokens": 5})
    texts = [c["text"] for c in answer["choices"]]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert texts == ["Ah", "BBh", "Ay", "BBy"]
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15}


def test_completion_beams_with_echo_start_with_the_prompt():
    answer = _answer({"prompt": "hi", **BEAM, "n": 2, "echo": True, "max_tokens": 5})
    assert [c["text"] for c in answer["choices"]] == ["hiAh", "hiBBh"]


def test_chat_beams_are_the_messages():
    answer = _answer({"messages": HI, **BEAM, "length_penalty": 2.0}, chat=True)
    ids = [ord(c) for c in "Q:hi\nA:"]
    assert answer["object"] == "chat.completion"
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert [c["message"] for c in answer["choices"]] == [
        {"role": "assistant", "content": beam_text(ids, i)} for i in range(4)
    ]
    assert [c["finish_reason"] for c in answer["choices"]] == ["length", "stop", "length", "stop"]
    assert answer["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 14, "total_tokens": len(ids) + 14}


# ---- refusals: a 400 naming the field, nothing queued ----------------------------------------
BAD = [
    ({**BEAM, "stream": True}, "stream"),
    ({**BEAM, "stream": True, "best_of": 8}, "stream"),
    ({**BEAM, "temperature": 0.5}, "temperature"),
    ({**BEAM, "top_p": 0.9}, "top_p"),
    ({**BEAM, "top_k": 5}, "top_k"),
    ({**BEAM, "min_p": 0.1}, "min_p"),
    ({**BEAM, "min_tokens": 1}, "min_tokens"),
    ({**BEAM, "seed": 7}, "seed"),
    ({**BEAM, "stop": "x"}, "stop"),
    ({**BEAM, "stop_token_ids": [5]}, "stop_token_ids"),
    ({**BEAM, "best_of": 8}, "best_of"),
    ({**BEAM, "n": MAX_BEAM_WIDTH + 1}, "n"),
    ({**BEAM, "n": 0}, "n"),
    ({**BEAM, "length_penalty": "1"}, "length_penalty"),
    ({**BEAM, "length_penalty": True}, "length_penalty"),
    ({**BEAM, "length_penalty": [1]}, "length_penalty"),
    ({**BEAM, "early_stopping": "always"}, "early_stopping"),
    ({**BEAM, "early_stopping": 1}, "early_stopping"),
    ({**BEAM, "early_stopping": "true"}, "early_stopping"),
    ({"use_beam_search": "yes"}, "use_beam_search"),
    ({"use_beam_search": 1, "n": 4}, "use_beam_search"),
    ({"length_penalty": 2.0}, "length_penalty"),  # without beam search it would be ignored
    ({"early_stopping": True}, "early_stopping"),
    ({"early_stopping": "never"}, "early_stopping"),
    ({"use_beam_search": False, "length_penalty": 0.5}, "length_penalty"),
]
COMPLETION_BAD = [
    ({**BEAM, "n": MAX_NUM_SEQS + 1}, "n"),  # more beams than the scripted engine runs sequences at once
    ({**BEAM, "logprobs": 0}, "logprobs"),
    ({**BEAM, "logprobs": 2, "echo": True}, "logprobs"),
    ({**BEAM, "max_tokens": 0}, "max_tokens"),
]
CHAT_BAD = [
    ({**BEAM, "n": MAX_NUM_SEQS + 1}, "n"),
    ({**BEAM, "logprobs": True}, "logprobs"),
    ({**BEAM, "logprobs": True, "top_logprobs": 2}, "logprobs"),
    ({**BEAM, "top_logprobs": 2}, "top_logprobs"),
    ({**BEAM, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**BEAM, "max_tokens": 0}, "max_tokens"),
]


@pytest.mark.parametrize(
    "chat, fields, param",
    [(False, f, p) for f, p in BAD + COMPLETION_BAD] + [(True, f, p) for f, p in BAD + CHAT_BAD],
)
def test_refused_beam_requests_name_the_field_and_queue_nothing(chat, fields, param):
    engine = ScriptedEngine()
    body = {"messages": HI, **fields} if chat else {"prompt": "hi", **fields}
    with pytest.raises(APIError) as e:
        _answer(body, chat, engine)
    assert (e.value.status, e.value.param, e.value.type) == (400, param, "invalid_request_error"), e.value.message
    assert engine.queued == []


def test_the_stream_refusal_says_beams_come_when_complete():
    with pytest.raises(APIError) as e:
        _answer({"prompt": "hi", **BEAM, "stream": True})
    assert "beam search" in e.value.message and "complete" in e.value.message


def test_refusals_reach_an_http_client_in_openais_schema():
    async def post(path, body):
        app = build_app(ScriptedEngine(), "fake")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.post(path, json=body)

    r = asyncio.run(post("/v1/chat/completions", {"messages": HI, **BEAM, "stream": True}))
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert (err["param"], err["type"], err["code"]) == ("stream", "invalid_request_error", None)
    r = asyncio.run(post("/v1/completions", {"prompt": "hi", **BEAM, "temperature": 1.0}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = asyncio.run(post("/v1/completions", {"prompt": "hi", **BEAM, "max_tokens": 2}))
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


def test_a_refused_request_leaves_a_beam_request_in_flight_alone():
    async def run():
        hold = asyncio.Event()
        engine = ScriptedEngine(hold)
        serving = OpenAIServing(engine, "fake")
        in_flight = asyncio.ensure_future(serving.create_completion({"prompt": "hi", **BEAM, "max_tokens": 5}))
        while not engine.queued:
            await asyncio.sleep(0)
        refused = []
        for fields, param in BAD:
            try:
                await serving.create_completion({"prompt": "hi", **fields})
            except APIError as e:
                refused.append(e.param == param)
        hold.set()
        return engine, await in_flight, refused

    engine, answer, refused = asyncio.run(run())
    assert refused == [True] * len(BAD)
    assert len(engine.queued) == 1 and not engine.streams[0].closed  # never aborted
    assert [c["text"] for c in answer["choices"]] == [beam_text([ord("h")], i) for i in range(4)]


# ---- the live server through the openai client ------------------------------------------------
PROMPT = "def fibonacci(n):\n    "


def test_openai_client_beam_search_shapes(live, client):
    extra = {"use_beam_search": True, "length_penalty": 0.8, "ignore_eos": True}
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=4, max_tokens=6, extra_body=extra)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" and isinstance(c.text, str) for c in out.choices)
    prompt_ids = live.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), 24)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Write a function."}],
        n=3,
        max_completion_tokens=5,
        extra_body={**extra, "early_stopping": True},
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in chat.choices)
    assert chat.usage.completion_tokens == 15


def test_openai_client_sees_the_refusals(client):
    def refused(**kw) -> str | None:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, **kw)
        return e.value.param

    beam = {"use_beam_search": True}
    assert refused(n=4, stream=True, extra_body=beam) == "stream"
    assert refused(n=4, temperature=0.8, extra_body=beam) == "temperature"
    assert refused(n=4, logprobs=1, extra_body=beam) == "logprobs"
    assert refused(n=4, best_of=5, extra_body=beam) == "best_of"
    assert refused(n=MAX_BEAM_WIDTH + 1, extra_body=beam) == "n"
    assert refused(n=4, extra_body={**beam, "length_penalty": "long"}) == "length_penalty"
    assert refused(n=4, extra_body={**beam, "early_stopping": "soon"}) == "early_stopping"
    assert refused(extra_body={"length_penalty": 0.5}) == "length_penalty"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL_NAME, messages=HI, n=2, logprobs=True, max_completion_tokens=2, extra_body=beam
        )
    assert e.value.param == "logprobs"


def test_refused_beam_requests_leave_a_stream_in_flight_alone(live, http):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 16, "stream": True, "ignore_eos": True}
    body["stream_options"] = {"include_usage": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        for fields, param in BAD:
            r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", **fields})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
        beam = {"model": MODEL_NAME, "prompt": "x", **BEAM, "max_tokens": 3, "ignore_eos": True}
        r = http.post("/v1/completions", json=beam)  # a valid beam request meanwhile
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
        rest = [json.loads(line[6:]) for line in [first, *lines] if line.startswith("data: {")]
    assert rest[-1]["usage"]["completion_tokens"] == 16  # the stream in flight got every token
    assert [c["choices"][0]["finish_reason"] for c in rest[:-1]][-1] == "length"


# ---- the beams' content: what the engine's beam search returns ---------------------------------
@pytest.fixture(scope="module")
def same_model_llm(server_model, live):
    """An LLM in this process on the live server's model, configured as the server's engine."""
    from pagedllm import LLM

    llm = LLM(
        server_model, device="cpu", block_size=live.async_llm.block_size, num_kv_blocks=live.async_llm.num_kv_blocks
    )
    yield llm
    llm.close()


def test_beams_equal_the_engines_beam_search(live, client, same_model_llm):
    """Choices = LLM.beam_search's sequences and LLM.generate(SamplingParams(use_beam_search=True))'s
    outputs on the same model, in order; 4 distinct beams (beam search never returns a hypothesis
    twice, where 4 parallel greedy samples would be 4 copies of one)."""
    from pagedllm import BeamSearchParams

    width, max_tokens, penalty = 4, 6, 0.7
    ids = live.tokenizer.encode(PROMPT, add_special_tokens=False)
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        n=width,
        max_tokens=max_tokens,
        extra_body={"use_beam_search": True, "length_penalty": penalty},
    )
    texts = [c.text for c in out.choices]
    params = SamplingParams(use_beam_search=True, n=width, max_tokens=max_tokens, length_penalty=penalty, temperature=0)
    (gen,) = same_model_llm.generate([PROMPT], params)
    assert [o.text for o in gen.outputs] == texts
    assert len({tuple(o.token_ids) for o in gen.outputs}) == width, "the beams are not distinct"
    assert [o.finish_reason for o in gen.outputs] == [c.finish_reason for c in out.choices]
    assert out.usage.completion_tokens == sum(len(o.token_ids) for o in gen.outputs)
    scores = [o.score for o in gen.outputs]
    assert scores == sorted(scores, reverse=True)
    (beams,) = same_model_llm.beam_search([PROMPT], BeamSearchParams(width, max_tokens, length_penalty=penalty))
    assert [s.output_text for s in beams.sequences] == texts
    assert [s.output_token_ids for s in beams.sequences] == [o.token_ids for o in gen.outputs]
    assert all(s.tokens == ids + s.output_token_ids for s in beams.sequences)
    # chat: the same beams as a completion of the template's prompt ids
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=HI, n=2, max_completion_tokens=5, extra_body={"use_beam_search": True}
    )
    rendered = live.tokenizer.apply_chat_template(HI, add_generation_prompt=True, tokenize=False)
    chat_ids = live.tokenizer.encode(rendered, add_special_tokens=False)
    (ref,) = same_model_llm.generate([chat_ids], SamplingParams(use_beam_search=True, n=2, max_tokens=5, temperature=0))
    assert [c.message.content for c in chat.choices] == [o.text for o in ref.outputs]
