"""/tokenize and /detokenize with vLLM's request and response shapes, without HTTP.

    POST /tokenize   {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
                  or {"messages": [...], "add_special_tokens": false, "chat_template_kwargs": {...}}
                  -> {"count": n, "max_model_len": m, "tokens": [ids], "token_strs": [str] | null}
    POST /detokenize {"tokens": [ids]} -> {"prompt": str}

`model` is optional (as in vLLM); when sent it must be one of the served names. `messages` go
through the chat template exactly as /v1/chat/completions builds its prompt (`chat_prompt`), so
`count` is the prompt length a chat request would have. Every other field is refused with a
400 naming it: a field that changed nothing would be a silent wrong answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pagedllm.engine.input_processor import encode_text
from pagedllm.entrypoints.chat_utils import SpecialTexts
from pagedllm.entrypoints.openai.chat import chat_prompt
from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.parsing import check_model, get, json_type

PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
# with `messages`: also the chat body fields that chat_prompt reads
CHAT_FIELDS = frozenset(
    {"model", "messages", "add_special_tokens", "return_token_strs", "chat_template_kwargs", "split_special_tokens"}
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


class TokenizerEngine(Protocol):
    """What the two endpoints use of AsyncLLM."""

    tokenizer: Any  # a Hugging Face tokenizer, or None (token-id prompts only)
    max_model_len: int
    vocab_size: int | None  # None: unknown, ids are checked against the tokenizer alone


def _refuse_unknown(body: dict[str, Any], known: frozenset[str], endpoint: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(f"'{unknown[0]}' is not supported on {endpoint}", unknown[0])


def _tokenizer(engine: TokenizerEngine, param: str) -> Any:
    if engine.tokenizer is None:
        raise bad_request("the model has no tokenizer: it takes and returns token ids only", param)
    return engine.tokenizer


def tokenize_body(
    body: dict[str, Any],
    engine: TokenizerEngine,
    served_model_names: Sequence[str],
    specials: SpecialTexts | None = None,
) -> dict[str, Any]:
    """The /tokenize answer of a parsed JSON body (APIError 400 naming the field at fault).
    specials: the tokenizer's SpecialTexts, made at start-up (chat_utils.SpecialTexts)."""
    check_model(body, served_model_names)
    chat = body.get("messages") is not None
    if chat and body.get("prompt") is not None:
        raise bad_request("send either 'prompt' or 'messages', not both", "prompt")
    _refuse_unknown(body, CHAT_FIELDS if chat else PROMPT_FIELDS, "/tokenize")
    strs = get(body, "return_token_strs", "bool", False)
    tok = _tokenizer(engine, "messages" if chat else "prompt")
    if chat:
        if get(body, "add_special_tokens", "bool", False):
            raise bad_request(
                "add_special_tokens=true with messages is not supported: the chat template writes the special tokens",
                "add_special_tokens",
            )
        ids = chat_prompt(body, tok, served_model_names[0], specials=specials)["prompt_token_ids"]
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request(f"'prompt' must be a string, got {json_type(prompt)}", "prompt")
        ids = encode_text(tok, prompt, get(body, "add_special_tokens", "bool", True))
    return {
        "count": len(ids),
        "max_model_len": engine.max_model_len,
        "tokens": ids,
        "token_strs": list(tok.convert_ids_to_tokens(ids)) if strs else None,
    }


def detokenize_body(body: dict[str, Any], engine: TokenizerEngine, served_model_names: Sequence[str]) -> dict[str, Any]:
    """The /detokenize answer: the text of `tokens` (special tokens included, as vLLM decodes)."""
    check_model(body, served_model_names)
    _refuse_unknown(body, DETOKENIZE_FIELDS, "/detokenize")
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad_request(f"'tokens' must be an array of token ids, got {json_type(tokens)}", "tokens")
    tok = _tokenizer(engine, "tokens")
    limit = engine.vocab_size if engine.vocab_size is not None else len(tok)
    for i, t in enumerate(tokens):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limit:
            raise bad_request(f"tokens[{i}] must be a token id in [0, {limit}), got {t!r}"[:200], "tokens")
    return {"prompt": tok.decode(tokens)}
