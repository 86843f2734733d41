"""The Python API shows pagedllm's INFO lines (the KV cache size) on stderr when the program
configured no logging, as vLLM does, once, and leaves a program's own logging set-up alone."""

from __future__ import annotations

import logging

import pytest

from pagedllm import LLM

ENGINE = dict(device="cpu", num_kv_blocks=16, block_size=8)


@pytest.fixture
def bare_logging(monkeypatch):
    """The logging of a plain `python script.py`: no handler anywhere, the "pagedllm" logger's
    level unset. (The test must still set aside pytest's handlers on the root logger itself:
    pytest adds them again at the start of each test phase.)"""
    ours = logging.getLogger("pagedllm")
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.delenv("PAGEDLLM_LOGGING_LEVEL", raising=False)
    level = ours.level
    ours.setLevel(logging.NOTSET)
    yield ours
    ours.setLevel(level)


def test_llm_shows_the_kv_cache_line_unless_logging_is_configured(tiny_models, bare_logging, capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    LLM(tiny_models["qwen3"], **ENGINE).close()
    err = capsys.readouterr().err
    assert err.count("KV cache: float32, 16 blocks") == 1, err
    assert len(bare_logging.handlers) == 1 and logging.getLogger().handlers == []  # the root is untouched
    LLM(tiny_models["qwen3"], **ENGINE).close()  # a second LLM adds no second handler
    assert capsys.readouterr().err.count("KV cache: float32, 16 blocks") == 1
    assert len(bare_logging.handlers) == 1

    # a program that configured logging itself (a handler on the root, as basicConfig adds) keeps control
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    bare_logging.handlers.clear()
    bare_logging.setLevel(logging.NOTSET)
    logging.getLogger().addHandler(Collect())
    LLM(tiny_models["qwen3"], **ENGINE).close()
    assert bare_logging.handlers == [] and "KV cache" not in capsys.readouterr().err
    assert not any("KV cache" in r.getMessage() for r in records)  # the root's level (WARNING) holds
