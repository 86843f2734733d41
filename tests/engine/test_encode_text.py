"""encode_text (every door's text -> ids) against Hugging Face's own `tokenizer.encode`: the same ids
whether it calls the Rust backend directly or falls back to the tokenizer."""

from __future__ import annotations

import random

import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from pagedllm import default_model_path
from pagedllm.engine.input_processor import encode_text, rust_backend

SPECIAL = "<|im_start|>user\nhi<|im_end|><|endoftext|>"


def texts(tok, n=40, seed=0):
    """Random-token text (as vLLM's benchmark client sends), special-token texts, unicode, whitespace."""
    rng = random.Random(seed)
    out = [tok.decode([rng.randrange(len(tok)) for _ in range(rng.randrange(1, 300))]) for _ in range(n)]
    return out + [SPECIAL, " leading", "trailing  \n\n", "naïve café 東京 🙂", "\t\t", "a" * 2000]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_the_backend_path_gives_the_tokenizers_ids(tok, add_special_tokens):
    assert rust_backend(tok) is not None  # the bundled tokenizer takes the direct path
    for t in texts(tok):
        assert encode_text(tok, t, add_special_tokens) == tok.encode(t, add_special_tokens=add_special_tokens), t


def test_a_bos_post_processor_is_applied_as_by_the_tokenizer(tmp_path):
    """add_special_tokens with a template that writes BOS/EOS (as Llama's tokenizers do)."""
    tok = AutoTokenizer.from_pretrained(default_model_path())
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A <|endoftext|>", special_tokens=[("<|endoftext|>", eos)]
    )
    tok.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    for t in texts(tok, n=10, seed=1):
        for special in (False, True):
            assert encode_text(tok, t, special) == tok.encode(t, add_special_tokens=special)
    assert encode_text(tok, "hi", True)[0] == eos and encode_text(tok, "hi", True)[-1] == eos


def test_a_backend_left_splitting_special_tokens_is_not_used(tok):
    """A chat's special-token text is encoded with split_special_tokens=True, which HF leaves set on
    the backend; the next plain encode must still match special tokens as HF's encode does."""
    split = encode_text(tok, SPECIAL, split_special_tokens=True)
    assert split == tok.encode(SPECIAL, add_special_tokens=False, split_special_tokens=True)
    assert rust_backend(tok) is None  # the backend is in the split state: go through the tokenizer
    plain = encode_text(tok, SPECIAL)
    assert plain == tok.encode(SPECIAL, add_special_tokens=False) and plain != split
    assert rust_backend(tok) is not None  # HF's encode set it back


def test_truncation_or_split_by_default_go_through_the_tokenizer(tmp_path):
    tok = AutoTokenizer.from_pretrained(default_model_path(), split_special_tokens=True)
    assert encode_text(tok, SPECIAL) == tok.encode(SPECIAL, add_special_tokens=False)
    assert len(encode_text(tok, SPECIAL)) > 4  # the special tokens were split, as asked
    tok = AutoTokenizer.from_pretrained(default_model_path())
    tok.backend_tokenizer.enable_truncation(8)
    assert rust_backend(tok) is None
    assert encode_text(tok, "a b c d e f g h i j k l m n o p") == tok.encode(
        "a b c d e f g h i j k l m n o p", add_special_tokens=False
    )


def test_empty_text_is_no_ids(tok):
    assert encode_text(tok, "") == []


def test_a_class_with_its_own_encode_goes_through_it():
    """A tokenizer class that changes encoding in Python (as CodeLlama's infilling or CPM's
    pre-segmentation do) is not bypassed."""
    from transformers import PreTrainedTokenizerFast

    class Shouting(PreTrainedTokenizerFast):
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus(text.upper() if isinstance(text, str) else text, *args, **kwargs)

    tok = Shouting.from_pretrained(default_model_path())
    assert rust_backend(tok) is None
    assert encode_text(tok, "quiet words") == tok.encode("QUIET WORDS", add_special_tokens=False)
    assert encode_text(tok, "quiet words") != encode_text(
        AutoTokenizer.from_pretrained(default_model_path()), "quiet words"
    )
