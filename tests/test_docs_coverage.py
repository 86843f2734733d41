"""The documentation names every public knob: each `LLM` argument and each `SamplingParams` field
appears (as `name`) on the Python API pages of docs/, so a new argument cannot land undocumented."""

from __future__ import annotations

import dataclasses
import inspect
import os

from pagedllm import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["python-api.md", "features/structured-output.md", "features/beam-search.md", "features/fp8-kv-cache.md"]
DERIVED = {"bad_words_token_ids", "stop_list"}  # filled by SamplingParams itself from `bad_words` / `stop`


def docs_text() -> str:
    return "".join(open(os.path.join(ROOT, "docs", p), encoding="utf-8").read() for p in PAGES)


def test_every_llm_argument_is_documented():
    text = docs_text()
    params = [p for p in inspect.signature(LLM.__init__).parameters if p not in ("self", "kwargs")]
    missing = [p for p in params if f"`{p}`" not in text]
    assert not missing, f"LLM arguments missing from docs/{PAGES[0]}: {missing}"


def test_every_sampling_params_field_is_documented():
    text = docs_text()
    fields = [f.name for f in dataclasses.fields(SamplingParams) if f.name not in DERIVED]
    missing = [f for f in fields if f"`{f}`" not in text and f"{f}=" not in text]
    assert not missing, f"SamplingParams fields missing from the docs: {missing}"
