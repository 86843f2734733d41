"""Speculative decoding through `pagedllm serve --speculative-config JSON` (the CLI's parse, the
engine core process, the OpenAI endpoints): greedy completions, streamed and not, are the text
`LLM` gives without speculation, and /metrics counts what `LLM` with the same config counts for
the same requests in the same order. Both methods: n-gram, and the target as its own draft model
(float32 on CPU: every proposal accepted)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from tests.server.helpers import metric, scrape, start_serve

# the first one's greedy output falls into a loop that prompt lookup finds (first: the engine's
# Backoff pauses lookups after steps that found nothing, as the other prompt's do)
PROMPTS = [[100 + i % 7 for i in range(30)], [5, 9, 14, 22, 5, 9, 14, 22, 5, 9, 14]]
MAX_TOKENS = 24
COUNTERS = ["spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"]


def spec_config(method: str, model: str) -> dict:
    spec: dict = {"num_speculative_tokens": 3, "disable_by_batch_size": None}
    if method == "ngram":
        return spec | {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    return spec | {"model": model}


def offline(model: str, spec: dict | None) -> tuple[list[str], dict]:
    """Each prompt twice in turn (as the server test sends them: not streamed, then streamed), one
    request at a time: the texts of the first pass and the speculation counters."""
    texts = []
    with LLM(model, device="cpu", num_kv_blocks=128, speculative_config=spec) as llm:
        for prompt in PROMPTS:
            for _ in range(2):
                out = llm.generate(
                    [{"prompt_token_ids": prompt}],
                    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                    use_tqdm=False,
                )[0].outputs[0]
                assert len(out.token_ids) == MAX_TOKENS
            texts.append(out.text)
        m = llm.get_metrics()
    return texts, {k: m.get(k, 0) for k in COUNTERS}


@pytest.fixture(scope="module")
def expected(tiny_models) -> list[str]:
    return offline(tiny_models["qwen3"], None)[0]


def completion_text(url: str, prompt: list[int], stream: bool) -> str:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_serve_with_speculation_gives_the_tokens_without(tiny_models, tmp_path, expected, method):
    model = tiny_models["qwen3"]
    spec = spec_config(method, model)
    texts, counters = offline(model, spec)
    assert texts == expected and counters["spec_decode_num_drafts"] > 0, counters
    args = ["--model", model, "--device", "cpu", "--num-kv-blocks", "128", "--served-model-name", "tiny"]
    args += ["--speculative-config", json.dumps(spec), "--log-level", "warning"]
    with open(tmp_path / "server.log", "w+") as log:
        p = start_serve(args, log)
        try:
            for prompt, want in zip(PROMPTS, expected, strict=True):
                assert completion_text(p.url, prompt, stream=False) == want
                assert completion_text(p.url, prompt, stream=True) == want
            # the core's metrics reach the API process after the last output (engine_core.py): read
            # until they have (the deadline only bounds a hang)
            deadline = time.monotonic() + 60
            while True:
                scraped = scrape(p.url)
                served = {k: metric(scraped, f"pagedllm:{k}_total") for k in COUNTERS}
                if served == counters or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert served == counters
            if method == "draft_model":
                assert counters["spec_decode_num_accepted_tokens"] == counters["spec_decode_num_draft_tokens"]
        finally:
            p.terminate()
            p.wait(60)
