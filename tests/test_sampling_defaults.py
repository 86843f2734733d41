"""One source of sampling defaults: the model's generation_config.json fills every field a request
leaves unset, and the same prompt + seed gives the same text through LLM.generate, `pagedllm
generate --seed` and /v1/completions.

The bundled model's generation_config.json sets temperature 0.7 and top_p 0.95, so the requests
here are sampled: a door that ignored the defaults or the seed would give other text.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest

from pagedllm import LLM, SamplingParams, default_model_path
from pagedllm.entrypoints import cli

PROMPT = "def fibonacci("
SEED = 1234
MAX_TOKENS = 24
KV_BLOCKS = 64


@pytest.fixture(scope="module")
def llm():
    with LLM(default_model_path(), device="cpu", num_kv_blocks=KV_BLOCKS) as llm:
        yield llm


@pytest.fixture(scope="module")
def llm_door(llm) -> str:
    params = dataclasses.replace(llm.get_default_sampling_params(), seed=SEED, max_tokens=MAX_TOKENS)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text


def text_of(llm: LLM, params: SamplingParams) -> str:
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text


def test_the_bundled_model_samples_by_default(llm, llm_door):
    assert llm.generation_defaults == {"temperature": 0.7, "top_p": 0.95}
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.max_tokens, d.seed) == (0.7, 0.95, 16, None)
    assert llm_door == text_of(llm, SamplingParams(temperature=0.7, top_p=0.95, seed=SEED, max_tokens=MAX_TOKENS))
    # the comparisons below can fail: without the model's defaults, or with another seed, the text differs
    assert llm_door != text_of(llm, SamplingParams(seed=SEED, max_tokens=MAX_TOKENS))
    assert llm_door != text_of(llm, SamplingParams(temperature=0.7, top_p=0.95, seed=SEED + 1, max_tokens=MAX_TOKENS))


def test_cli_door_equals_llm_generate(llm_door, capsys):
    argv = ["generate", "--seed", str(SEED), "--max-tokens", str(MAX_TOKENS), "--device", "cpu"]
    assert cli.main([*argv, "--num-kv-blocks", str(KV_BLOCKS), PROMPT]) == 0
    assert capsys.readouterr().out == PROMPT + llm_door + "\n"


def test_server_door_equals_llm_generate(llm, llm_door):
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.routes import build_app

    async_llm = AsyncLLM(llm=llm)
    try:
        with TestClient(build_app(async_llm, "m")) as client:
            r = client.post("/v1/completions", json={"prompt": PROMPT, "seed": SEED, "max_tokens": MAX_TOKENS})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == llm_door
    finally:
        async_llm.shutdown()


@pytest.fixture(scope="module")
def greedy_model(tiny_models, tmp_path_factory) -> str:
    """The tiny qwen3 whose generation_config.json asks for greedy decoding of 5 new tokens."""
    d = tmp_path_factory.mktemp("greedy_defaults")
    for f in os.listdir(tiny_models["qwen3"]):
        shutil.copy(os.path.join(tiny_models["qwen3"], f), d / f)
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0, "max_new_tokens": 5}))
    return str(d)


def test_generate_without_params_applies_the_model_defaults(greedy_model):
    prompts = [[5, 6, 7], [9, 9, 1]]
    with LLM(greedy_model, device="cpu", num_kv_blocks=32, block_size=8) as llm:
        implicit = [o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)]
        explicit = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
        assert implicit == [o.outputs[0].token_ids for o in explicit]
        long = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 16 for o in long)
    with LLM(greedy_model, device="cpu", num_kv_blocks=32, block_size=8, generation_config="vllm") as llm:
        assert llm.generation_defaults == {} and llm.get_default_sampling_params() == SamplingParams()
        ignored = llm.generate(prompts, use_tqdm=False)  # temperature 1.0, max_tokens 16
        assert [o.outputs[0].token_ids for o in ignored] != implicit
