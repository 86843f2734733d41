"""Prompt -> token ids, and the admission checks every request passes (one set of rules and
messages, used by LLMEngine and by the server's API process alike)."""
from __future__ import annotations

from typing import Any


class InputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int | None, max_model_len: int, block_size: int,
                 num_kv_blocks: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len, self.block_size, self.num_kv_blocks = max_model_len, block_size, num_kv_blocks

    def tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        """str | list[int] | {"prompt_token_ids": [...]} | {"prompt": str} -> (text, token ids)."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(f"prompt dict has unknown keys {sorted(unknown)}; "
                                 "use 'prompt' or 'prompt_token_ids'")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.check_ids(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the engine has no tokenizer; pass token ids")
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=False)) if prompt else []
        if isinstance(prompt, (list, tuple)):
            return None, self.check_ids(prompt)
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        bad = [t for t in ids if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)]
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return list(ids)

    def validate_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Empty prompts, prompts of max_model_len tokens or more, and requests that could never
        fit in the whole KV pool are refused."""
        if num_prompt_tokens == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"prompt has {num_prompt_tokens} tokens; max_model_len is {self.max_model_len}, "
                             "so at most max_model_len - 1 fit")
        need = -(-min(num_prompt_tokens + max_tokens, self.max_model_len) // self.block_size)
        if need > self.num_kv_blocks:
            raise ValueError(f"request needs {need} KV blocks (prompt {num_prompt_tokens} + max_tokens "
                             f"{max_tokens}) but the KV cache has only {self.num_kv_blocks}")
