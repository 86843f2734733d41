"""The bundled default model: loads with HF unchanged, and the engine's greedy output equals
HF transformers' (CPU, float32) for several prompts."""

import os

import pytest

from pagedllm import LLM, SamplingParams, default_model_path
from tests.model.hf_reference import hf_greedy

PROMPTS = ["def fibonacci(", "import ", "class Stack:\n    def ", "for i in range(", "    return self."]


@pytest.fixture(scope="module")
def llm():
    return LLM(default_model_path(), device="cpu", num_kv_blocks=128)


def test_default_model_ships_a_normal_hf_directory():
    files = set(os.listdir(default_model_path()))
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    } <= files
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    assert tok.eos_token == "<|endoftext|>" and tok.chat_template


def test_greedy_equals_hf_on_the_default_model(llm):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=False):
        ids = tok.encode(prompt, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(default_model_path(), ids, 24), prompt


def test_default_model_writes_python(llm):
    out = llm.generate("def fibonacci(", SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    text = out.outputs[0].text
    assert ")" in text and ":" in text
