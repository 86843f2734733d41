"""Helpers shared by the test packages: the tiny model families and how they are written
(random-weight HF models, a small trained BPE tokenizer; no downloads). The fixture that
writes them once per session is in conftest.py."""

from __future__ import annotations

import importlib.util
import os
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ["qwen3", "qwen2", "llama"]
VOCAB = 384

CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks.",
    "for i in range(10):\n    print(i, i * i)\n",
    "héllo wörld — ünïcode ✓ 你好",
]


def load_script(relpath: str) -> types.ModuleType:
    """A script of the repository that is not in the package (e.g. benchmarks/beam_search.py), imported."""
    name = os.path.splitext(relpath)[0].replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relpath))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_tokenizer(out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out_dir)


# the tiny random models' shape (any family's config class takes these)
TINY_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
)


def build_model(family: str, out_dir: str, eos_id: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(TINY_SHAPE, eos_token_id=eos_id, bos_token_id=None)
    torch.manual_seed({"qwen3": 1, "qwen2": 2, "llama": 3}[family])
    if family == "qwen3":
        cfg = Qwen3Config(head_dim=16, tie_word_embeddings=True, rope_theta=1e6, **common)
        model = Qwen3ForCausalLM(cfg)
    elif family == "qwen2":
        cfg = Qwen2Config(tie_word_embeddings=False, rope_theta=1e6, **common)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # make the qkv biases matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    else:
        cfg = LlamaConfig(
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **common,
        )
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(out_dir, safe_serialization=True)
