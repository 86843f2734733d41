"""A config with sliding-window layers is refused at start-up, naming `sliding_window`, unless
max_model_len keeps every key inside the window, where full attention is the windowed result
exactly (checked against HF transformers, which applies the window)."""

import os
import shutil

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.errors import InvalidRequestError
from tests.helpers import TINY_SHAPE
from tests.model.hf_reference import hf_greedy

WINDOW = 32


def build(kind: str, out: str, tok_dir: str) -> str:
    import torch
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(TINY_SHAPE, max_position_embeddings=256, bos_token_id=None)
    torch.manual_seed(5)
    if kind == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=WINDOW, **common))
    else:  # Qwen2: the window on the layers from max_window_layers on
        cfg = Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **common)
        model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    for f in os.listdir(tok_dir):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            shutil.copy(os.path.join(tok_dir, f), out)
    return out


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def windowed(request, tiny_models, tmp_path_factory):
    return build(request.param, str(tmp_path_factory.mktemp(request.param)), tiny_models["qwen3"])


def test_a_window_smaller_than_the_context_is_refused_naming_it(windowed):
    with pytest.raises(InvalidRequestError, match=f"sliding_window={WINDOW}") as e:
        LLM(windowed, num_kv_blocks=32)  # max_model_len defaults to 256
    assert e.value.param == "max_model_len"
    with pytest.raises(InvalidRequestError, match="sliding_window"):
        LLM(windowed, num_kv_blocks=32, max_model_len=WINDOW + 1)


def test_within_the_window_the_tokens_are_the_models(windowed):
    llm = LLM(windowed, num_kv_blocks=32, block_size=8, max_model_len=WINDOW)
    prompts = [[(7 * i + j) % 300 + 1 for j in range(n)] for i, n in enumerate((5, 12, 20))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=WINDOW - 20, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(windowed, p, WINDOW - 20)


def test_configs_without_windowed_layers_still_load(tiny_models):
    LLM(tiny_models["qwen2"], num_kv_blocks=16)  # Qwen2 with use_sliding_window False


def test_the_new_families_windows_are_guarded_the_same_way():
    """Gemma's alternating windows (from layer_types) and Phi-3's window on every layer."""
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config

    from pagedllm.model.registry import check_window

    for cfg in (
        Gemma2Config(architectures=["Gemma2ForCausalLM"], sliding_window=WINDOW, **TINY_SHAPE),
        Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], sliding_window=WINDOW, **TINY_SHAPE),
        Phi3Config(architectures=["Phi3ForCausalLM"], sliding_window=WINDOW, pad_token_id=None, **TINY_SHAPE),
    ):
        with pytest.raises(ValueError, match=f"sliding_window={WINDOW}"):
            check_window(cfg, WINDOW + 1)
        check_window(cfg, WINDOW)
    check_window(Phi3Config(architectures=["Phi3ForCausalLM"], pad_token_id=None, **TINY_SHAPE), 512)
