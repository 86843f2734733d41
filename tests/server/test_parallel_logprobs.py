"""`n`, `best_of`, `logprobs`, `top_logprobs` and `echo` on /v1/completions and
/v1/chat/completions.

Two halves: OpenAIServing driven with a scripted engine whose RequestOutputs carry hand-built
logprobs (the exact OpenAI shapes, streamed and not, independent of the model), then the live
server through the official `openai` client on the tiny model (parallel sampling, seeds, stop
strings with n > 1, echo, logprob values checked against themselves: greedy picks the best
logprob, the streamed lists equal the non-streamed ones, best_of keeps the best sample)."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.serving import OpenAIServing, SSEStream
from tests.server.helpers import MODEL_NAME, fresh_scrape, metric


# ---- a scripted engine -------------------------------------------------------------------
class CharTokenizer:
    """One token per character: id = ord(c) (printable ASCII)."""

    chat_template = "{{ messages }}"
    added_tokens_decoder: dict = {}

    def encode(self, text, add_special_tokens=False, **kw):
        return [ord(c) for c in text]

    def decode(self, ids, **kw):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, conversation, add_generation_prompt, tokenize):
        return "Q:" + conversation[-1]["content"] + "\nA:"


def entry(token_id: int, pos: int, k: int) -> dict[int, Logprob]:
    """The position's token first, then the top k ('a', 'b', ...; the token is 'z' + pos: never
    among them); the last of the top k is -inf (a token the logits rule out)."""
    e = {token_id: Logprob(-2.0 - pos, rank=k + 1, decoded_token=chr(token_id))}
    for j in range(k):
        e[ord("a") + j] = Logprob(-math.inf if j == k - 1 and k > 1 else -0.1 * (j + 1), j + 1, chr(ord("a") + j))
    return e


COMPLETIONS = ["XYZ", "PQ"]  # choice i's tokens (choice 1 finishes a step earlier, by a stop token)


class ScriptedEngine:
    """What the server uses of AsyncLLM; each request streams COMPLETIONS[:n], one token per
    sequence per output, with logprobs when the params ask (and prompt logprobs)."""

    def __init__(self):
        self.generation_defaults: dict = {}
        self.timeline = None  # no PAGEDLLM_TIMELINE
        self.tokenizer = CharTokenizer()
        self.input_processor = InputProcessor(self.tokenizer, 128, 64, 8, 64)
        self.model_path = "/models/fake"
        self.max_model_len, self.num_kv_blocks, self.block_size = 64, 64, 8
        self.is_running, self.is_dead = True, False
        self.finish_callbacks: list = []
        self.queued: list = []

    def add_request(self, request, params=None, request_id=None, *, stream=True):
        self.queued.append(request)
        return _Script(request, stream)


class _Script:
    def __init__(self, request, stream: bool):
        p = request.params
        k, pk = p.logprobs, p.prompt_logprobs
        ids = request.prompt_token_ids
        prompt_lps = None if pk is None else [None] + [entry(t, j, pk) for j, t in enumerate(ids[1:])]
        texts = COMPLETIONS[: p.n]
        steps = max(map(len, texts))
        outs = []
        for step in range(1, steps + 1):
            choices = []
            for i, full in enumerate(texts):
                text = full[:step]
                toks = [ord(c) for c in text]
                new = toks[len(full[: step - 1]) :]
                done = step >= len(full)
                choices.append(
                    CompletionOutput(
                        i,
                        text,
                        toks,
                        ("length" if i == 0 else "stop") if done else None,
                        None,
                        logprobs=None if k is None else [entry(t, j, k) for j, t in enumerate(toks)],
                        delta_text=text[len(full[: step - 1]) :] if step <= len(full) else "",
                        delta_token_ids=new if step <= len(full) else [],
                    )
                )
            outs.append(
                RequestOutput(request.request_id, request.prompt, ids, choices, step == steps, 0, None, prompt_lps)
            )
        self.outputs = outs if stream else outs[-1:]

    async def __aiter__(self):
        for out in self.outputs:
            yield out

    def close(self) -> None:
        pass


def _events(stream: SSEStream) -> list[dict]:
    async def collect():
        try:
            return [e async for e in stream.events]
        finally:
            stream.close()

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[6:]) for e in events[:-1]]


def _complete(body: dict):
    return asyncio.run(OpenAIServing(ScriptedEngine(), "fake").create_completion(body))


def _chat(body: dict):
    return asyncio.run(OpenAIServing(ScriptedEngine(), "fake").create_chat_completion(body))


# ---- shapes ---------------------------------------------------------------------------------
def test_completion_logprobs_with_echo_exact_shape():
    answer = _complete({"prompt": "hi", "n": 2, "logprobs": 2, "echo": True, "max_tokens": 4})
    c0, c1 = answer["choices"]
    assert (c0["index"], c0["text"], c0["finish_reason"]) == (0, "hiXYZ", "length")
    assert (c1["index"], c1["text"], c1["finish_reason"]) == (1, "hiPQ", "stop")
    assert c0["logprobs"] == {
        "tokens": ["h", "i", "X", "Y", "Z"],
        "token_logprobs": [None, -2.0, -2.0, -3.0, -4.0],  # the first prompt token has none
        "top_logprobs": [
            None,
            {"i": -2.0, "a": -0.1, "b": -9999.0},  # the token itself, then the top 2 (-inf clamped)
            {"X": -2.0, "a": -0.1, "b": -9999.0},
            {"Y": -3.0, "a": -0.1, "b": -9999.0},
            {"Z": -4.0, "a": -0.1, "b": -9999.0},
        ],
        "text_offset": [0, 1, 2, 3, 4],
    }
    assert c1["logprobs"]["tokens"] == ["h", "i", "P", "Q"]
    # prompt once, completion tokens of every returned choice
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}


def test_completion_echo_of_token_ids_and_logprobs_zero():
    answer = _complete({"prompt": [104, 105], "echo": True, "max_tokens": 4})
    assert answer["choices"][0]["text"] == "hiXYZ" and answer["choices"][0]["logprobs"] is None
    lp = _complete({"prompt": "hi", "logprobs": 0, "max_tokens": 4})["choices"][0]["logprobs"]
    assert lp["tokens"] == ["X", "Y", "Z"] and lp["top_logprobs"] == [{"X": -2.0}, {"Y": -3.0}, {"Z": -4.0}]


def test_completion_stream_chunks_per_choice_and_offsets_continue():
    body = {"prompt": ["hi", "yo"], "n": 2, "logprobs": 1, "echo": True, "stream": True, "max_tokens": 4}
    body["stream_options"] = {"include_usage": True}
    chunks = _events(_complete(body))
    final = _complete({**body, "stream": False, "stream_options": None})
    by_index: dict[int, list[dict]] = {}
    for c in chunks[:-1]:
        assert len(c["choices"]) == 1
        by_index.setdefault(c["choices"][0]["index"], []).append(c["choices"][0])
    assert sorted(by_index) == [0, 1, 2, 3]  # prompt p's choices are 2p, 2p + 1
    for choice in final["choices"]:
        parts = by_index[choice["index"]]
        assert [p["finish_reason"] for p in parts[:-1]] == [None] * (len(parts) - 1)
        assert parts[-1]["finish_reason"] == choice["finish_reason"]  # each choice ends on its own chunk
        assert "".join(p["text"] for p in parts) == choice["text"]
        assert parts[0]["text"].startswith(("hi", "yo"))  # the echo leads the first chunk
        joined = {k: [x for p in parts for x in p["logprobs"][k]] for k in choice["logprobs"]}
        assert joined == choice["logprobs"]  # text_offset continues from chunk to chunk
        assert all(len(p["logprobs"]["tokens"]) <= 3 for p in parts)  # a chunk holds its own tokens only
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == final["usage"]


def test_chat_logprobs_exact_shape_streamed_and_not():
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "logprobs": True, "top_logprobs": 1}
    answer = _chat({**body, "max_tokens": 4})
    c0 = answer["choices"][0]
    assert c0["message"]["content"] == "XYZ" and answer["choices"][1]["index"] == 1
    assert c0["logprobs"]["content"][0] == {
        "token": "X",
        "logprob": -2.0,
        "bytes": [88],
        "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]}],  # the best, not the token
    }
    assert [t["token"] for t in c0["logprobs"]["content"]] == ["X", "Y", "Z"]
    assert answer["usage"]["completion_tokens"] == 5
    chunks = _events(_chat({**body, "stream": True, "max_tokens": 4}))
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    for choice in answer["choices"]:
        parts = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]][1:]
        assert "".join(p["delta"].get("content", "") for p in parts) == choice["message"]["content"]
        assert [x for p in parts for x in p["logprobs"]["content"]] == choice["logprobs"]["content"]
        assert parts[-1]["finish_reason"] == choice["finish_reason"]
    no_top = _chat({**body, "top_logprobs": None, "max_tokens": 4})["choices"][0]["logprobs"]["content"]
    assert no_top[0]["top_logprobs"] == [] and no_top[0]["logprob"] == -2.0


def test_fields_reach_sampling_params():
    engine = ScriptedEngine()
    serving = OpenAIServing(engine, "fake")
    asyncio.run(serving.create_completion({"prompt": "hi", "n": 2, "best_of": 3, "logprobs": 4, "echo": True}))
    asyncio.run(serving.create_completion({"prompt": "hi", "logprobs": 4}))
    asyncio.run(serving.create_chat_completion({"messages": [{"role": "user", "content": "x"}], "logprobs": True}))
    asyncio.run(serving.create_chat_completion({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 0}))
    chat = {"messages": [{"role": "user", "content": "x"}], "n": 2, "best_of": 4, "logprobs": True, "top_logprobs": 3}
    asyncio.run(serving.create_chat_completion(chat))
    got = [(r.params.n, r.params.best_of, r.params.logprobs, r.params.prompt_logprobs) for r in engine.queued]
    assert got == [(2, 3, 4, 4), (1, None, 4, None), (1, None, 0, None), (1, None, None, None), (2, 4, 3, None)]


@pytest.mark.parametrize(
    "chat, body, param",
    [
        (False, {"n": 0}, "n"),
        (False, {"n": -1}, "n"),
        (False, {"n": "2"}, "n"),
        (False, {"n": 1.5}, "n"),
        (False, {"n": 3, "best_of": 2}, "best_of"),
        (False, {"best_of": 0}, "best_of"),
        (False, {"best_of": "3"}, "best_of"),
        (False, {"best_of": 2, "stream": True}, "best_of"),  # ranked samples cannot be streamed
        (False, {"logprobs": 21}, "logprobs"),
        (False, {"logprobs": -1}, "logprobs"),
        (False, {"logprobs": True}, "logprobs"),
        (False, {"logprobs": 2.0}, "logprobs"),
        (False, {"echo": "yes"}, "echo"),
        (True, {"logprobs": 1}, "logprobs"),
        (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (True, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        (True, {"logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
        (True, {"top_logprobs": 2}, "top_logprobs"),  # top_logprobs needs logprobs
        (True, {"n": 0}, "n"),
        (True, {"n": 2, "best_of": 1}, "best_of"),
    ],
)
def test_bad_fields_are_400_naming_the_field(chat, body, param):
    with pytest.raises(APIError) as e:
        if chat:
            _chat({"messages": [{"role": "user", "content": "x"}], **body})
        else:
            _complete({"prompt": "hi", **body})
    assert (e.value.status, e.value.param) == (400, param), e.value.message


# ---- the live server --------------------------------------------------------------------------
PROMPT = "def fibonacci(n):\n    "
SAMPLED = dict(temperature=1.0, extra_body={"ignore_eos": True, "top_k": 50})
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_n3_distinct_seeded_choices_each_equal_to_its_own_seed(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, n=3, seed=11, **SAMPLED)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    texts = [c.text for c in out.choices]
    assert len(set(texts)) == 3, texts
    assert out.usage.completion_tokens == 15
    # sample i draws with seed + i: the same tokens as a request of its own with that seed
    for i in range(3):
        alone = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, seed=11 + i, **SAMPLED)
        assert alone.choices[0].text == texts[i]


def test_n3_streamed_equals_non_streamed(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, n=3, seed=5, **SAMPLED)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 15
    for c in full.choices:
        parts = [ch.choices[0] for ch in chunks[:-1] if ch.choices[0].index == c.index]
        assert "".join(p.text for p in parts) == c.text
        assert [p.finish_reason for p in parts].count("length") == 1 and parts[-1].finish_reason == "length"
    assert {ch.choices[0].index for ch in chunks[:-1]} == {0, 1, 2}


def test_chat_n2(client):
    messages = [{"role": "user", "content": "Write a haiku."}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, n=2, seed=3, **SAMPLED)
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].message.content != out.choices[1].message.content
    assert out.usage.completion_tokens == 12
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=6, n=2, seed=3, stream=True, **SAMPLED
        )
    )
    for c in out.choices:
        parts = [ch.choices[0] for ch in chunks if ch.choices[0].index == c.index]
        assert parts[0].delta.role == "assistant"
        assert "".join(p.delta.content or "" for p in parts) == c.message.content
        assert parts[-1].finish_reason == "length"


def test_stop_string_in_one_choice_lets_the_others_finish(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, n=2, seed=21, **SAMPLED)
    base = [c.text for c in client.completions.create(**kw).choices]
    stop = next(
        (
            base[0][i : i + 2]
            for i in range(2, len(base[0]) - 2)
            if base[0][i : i + 2].strip() and base[0][i : i + 2] not in base[1]
        ),
        None,
    )
    assert stop is not None, base
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(stop=[stop], stream=True, **kw))
            texts = ["".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i) for i in (0, 1)]
            reasons = [[ch.choices[0].finish_reason for ch in chunks if ch.choices[0].index == i][-1] for i in (0, 1)]
        else:
            out = client.completions.create(stop=[stop], **kw)
            texts, reasons = [c.text for c in out.choices], [c.finish_reason for c in out.choices]
        assert texts == [base[0][: base[0].find(stop)], base[1]] and reasons == ["stop", "length"], stream


def test_echo_text_and_token_id_prompts(live, client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, echo=True, n=2, **GREEDY)
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, **GREEDY).choices[0].text
    assert [c.text for c in out.choices] == [PROMPT + plain] * 2
    assert out.usage.prompt_tokens == len(live.tokenizer.encode(PROMPT, add_special_tokens=False))
    ids = live.tokenizer.encode(PROMPT, add_special_tokens=False)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, echo=True, **GREEDY)
    assert by_ids.choices[0].text == live.tokenizer.decode(ids) + plain
    chunks = list(
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, echo=True, stream=True, **GREEDY)
    )
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + plain


def test_fork_metrics_count_the_children(live, client):
    before = fresh_scrape(live.url, live.async_llm)  # the core's counters, up to date (not a step behind)
    client.completions.create(model=MODEL_NAME, prompt=PROMPT * 2, max_tokens=4, n=4, seed=1, **SAMPLED)
    after = fresh_scrape(live.url, live.async_llm)
    forked = metric(after, "pagedllm:forked_sequences_total") - metric(before, "pagedllm:forked_sequences_total")
    assert forked == 3
    assert metric(after, "pagedllm:copy_on_write_blocks_total") >= metric(before, "pagedllm:copy_on_write_blocks_total")
    assert any(n == "pagedllm:copy_on_write_blocks_total" for n, _, _ in after)


def test_limits_are_400_and_leave_a_stream_in_flight_alone(live, http):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 16, "stream": True, "ignore_eos": True, "n": 2}
    body["stream_options"] = {"include_usage": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        bad = [
            ({"n": 2**64}, "n"),  # more sequences than the engine runs at once
            ({"best_of": 10**6}, "best_of"),
            ({"n": 0}, "n"),
            ({"best_of": 1, "n": 2}, "best_of"),
            ({"best_of": 3, "stream": True}, "best_of"),
            ({"logprobs": 21}, "logprobs"),
        ]
        for fields, param in bad:
            r = httpx.post(
                live.base_url + "/completions",
                json={"model": MODEL_NAME, "prompt": "x", **fields},
                headers=http.headers,
                timeout=60,
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}
        r = httpx.post(live.base_url + "/chat/completions", json=chat, headers=http.headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
        rest = [json.loads(line[6:]) for line in [first, *lines] if line.startswith("data: {")]
    assert rest[-1]["usage"]["completion_tokens"] == 32  # the stream in flight got every token


# ---- values: these need the engine's logprobs (SamplingParams.logprobs filled in the outputs) -------
def test_completion_logprobs_greedy_token_is_the_best_and_stream_matches(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    full = client.completions.create(**kw)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 3 <= len(top) <= 4
        assert value == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the raw logits' best
        assert tok in top
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(6)]
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    assert [v for c in chunks for v in c.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs)


def test_echo_with_logprobs_scores_the_prompt(live, client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, logprobs=2, echo=True, **GREEDY)
    lp = out.choices[0].logprobs
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:])


def test_chat_logprobs_top_logprobs(client):
    messages = [{"role": "user", "content": "Say something."}]
    kw = dict(model=MODEL_NAME, messages=messages, max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY)
    out = client.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)  # greedy
        assert item.bytes == list(item.token.encode("utf-8", errors="replace"))
    assert "".join(i.token for i in content) == out.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert [i.token for c in chunks if c.choices[0].logprobs for i in c.choices[0].logprobs.content] == [
        i.token for i in content
    ]


def test_best_of_returns_the_best_sample(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, seed=7, logprobs=0, **SAMPLED)
    candidates = client.completions.create(n=3, **kw).choices  # the same samples: seeds 7, 8, 9
    scores = [sum(c.logprobs.token_logprobs) for c in candidates]
    best = client.completions.create(n=1, best_of=3, **kw)
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert best.choices[0].text == candidates[scores.index(max(scores))].text
    assert best.usage.completion_tokens == 6  # the returned choice only
    two = client.completions.create(n=2, best_of=3, **kw).choices
    ranked = sorted(range(3), key=lambda i: -scores[i])
    assert [c.text for c in two] == [candidates[i].text for i in ranked[:2]]
