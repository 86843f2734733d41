"""Server fixtures: a live OpenAI-compatible server (uvicorn in a background thread of this
process, on an ephemeral 127.0.0.1 port, CPU, small KV cache) and clients for it. Helpers
the tests import are in tests/server/helpers.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.server.helpers import API_KEY, CHAT_TEMPLATE, MODEL_NAME, LiveServer, pick_model, pid_alive

BLOCK_SIZE = 16


@pytest.fixture(scope="session")
def server_model(tiny_models) -> str:
    return pick_model(tiny_models)


@pytest.fixture(scope="session")
def long_context_model(tiny_models, tmp_path_factory):
    """The tiny qwen3 with a 32k context, so one request can run for as long as a test needs."""
    d = tmp_path_factory.mktemp("long_ctx")
    src = tiny_models["qwen3"]
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), d / f)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 32768
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.fixture(scope="session")
def live(server_model):
    """The server as `pagedllm serve` runs it: the engine in its own core process. The KV cache
    holds fewer tokens than max_model_len, so a request can be too long for the cache alone.
    One for the session (its start is the slow part): a test that changes it restores it."""
    from pagedllm.entrypoints.async_llm import AsyncLLM
    from pagedllm.entrypoints.model_dir import load_hf_config
    from pagedllm.entrypoints.openai.routes import build_app

    num_kv_blocks = min(256, load_hf_config(server_model).max_position_embeddings // BLOCK_SIZE - 1)
    async_llm = AsyncLLM(
        server_model, device="cpu", block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks, max_num_seqs=256
    )
    if not getattr(async_llm.tokenizer, "chat_template", None):
        async_llm.tokenizer.chat_template = CHAT_TEMPLATE
    srv = LiveServer(build_app(async_llm, MODEL_NAME, API_KEY)).start()
    srv.async_llm = async_llm
    srv.tokenizer = async_llm.tokenizer
    srv.max_model_len = async_llm.max_model_len
    yield srv
    srv.stop()
    async_llm.shutdown()
    assert not pid_alive(async_llm.core_pid)


@pytest.fixture(scope="module")
def client(live):
    import openai

    with openai.OpenAI(base_url=live.base_url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(live):
    import httpx

    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c
