"""The edge: (prompt, SamplingParams) -> a checked EngineCoreRequest, once per request.

Every door (LLM.generate, the CLI, AsyncLLM and the server) passes its requests through
`InputProcessor.process`; what comes out is known good, so the layers below (the engine core,
the scheduler) only assert their preconditions. Every refusal is an InvalidRequestError whose
`param` names the field (`prompt`, `max_tokens`, `stop_token_ids`, `n`, `best_of`,
`sampling_params`) and whose `code` is `context_length_exceeded` when the
request is too long for the model or the KV cache.

Parallel sampling: a request's sequences (SamplingParams.num_samples: best_of, or n) run in waves
of at most max_num_seqs (engine/core.py): any number up to MAX_SAMPLES is accepted, more is
refused naming `best_of` when it is set, else `n`. A beam search's beams wait for each other
every step, so its width must fit in max_num_seqs.

The length rule: prompt + max_tokens must fit in max_model_len (as OpenAI and vLLM refuse it);
a max_tokens beyond the room left is refused, never clamped. A door that wants "as much as fits"
sets max_tokens to the room itself (the chat endpoint does when the client sets none).
truncate_prompt_tokens is applied before it (a truncated prompt has no text: it no longer
matches the ids).

Token controls: logit_bias keys, allowed_token_ids and the bad words' token ids are checked
against the vocabulary here (SamplingParams checked their types), naming the field; bad_words
are tokenized here into SamplingParams.bad_words_token_ids.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.grammar import GrammarChecker
from pagedllm.engine.kv_cache_groups import KVCacheGroup, blocks_per_sequence
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.engine.sampling_params import TOKEN_ID_MAX, SamplingParams, all_ints, first_outside, has_surrogate

if TYPE_CHECKING:
    from llguidance import LLTokenizer

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


# Samples of one request (n, or best_of): they run in waves of max_num_seqs, each wave's first
# sequence computing the prompt again (from the prefix cache when it is on); every sample's
# outputs are kept until the request ends.
MAX_SAMPLES = 4096


# transformers 5's fast-tokenizer encode: the base class's `encode` over TokenizersBackend's
# `_encode_plus`, which is the backend's `encode_batch` (read in transformers 5.0 and 5.25)
PLAIN_ENCODE = ("PreTrainedTokenizerBase.encode", "TokenizersBackend._encode_plus")


class RustTokenizer(Protocol):
    """What encode_text reads of a fast tokenizer's backend (`tokenizers.Tokenizer`)."""

    truncation: Any
    padding: Any
    encode_special_tokens: bool

    def encode_batch_fast(self, inputs: list[str], add_special_tokens: bool = True) -> list[Any]: ...


def rust_backend(tokenizer: Any) -> RustTokenizer | None:
    """A Hugging Face fast tokenizer's Rust backend when calling it directly gives the ids
    `tokenizer.encode(text)` gives: that call is the backend's `encode_batch` once the tokenizer has
    set no truncation, no padding and its split_special_tokens default on the backend, and the
    backend is in that state now. None otherwise (a slow or other tokenizer, or a backend left
    splitting special tokens by an earlier call): encode through the tokenizer."""
    if not getattr(tokenizer, "is_fast", False):  # PreTrainedTokenizerBase.is_fast: HF's own flag
        return None
    cls = type(tokenizer)
    if (getattr(cls.encode, "__qualname__", ""), getattr(cls._encode_plus, "__qualname__", "")) != PLAIN_ENCODE:
        return None  # a class with an encode of its own (CodeLlama's infilling, CPM's pre-segmentation)
    backend: RustTokenizer = tokenizer.backend_tokenizer
    if backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != bool(tokenizer.split_special_tokens):
        return None
    return backend


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = False, **kwargs: Any) -> list[int]:
    """Text -> token ids: the one place every door encodes text (a prompt here, /tokenize, each piece
    of a rendered chat). add_special_tokens: the tokenizer's BOS/EOS around it; kwargs go to
    `tokenizer.encode` (a chat's special-token texts: split_special_tokens). "" -> [].

    Without kwargs a fast tokenizer's backend is called directly and without character offsets
    (`encode_batch_fast`): the same ids, 20-25% less time on a 512-token prompt of new text
    (benchmarks/request_prep.py, prepare_text_fresh_us), which vLLM's client sends."""
    if not text:
        return []
    backend = None if kwargs else rust_backend(tokenizer)
    if backend is not None:
        return list(backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens, **kwargs))


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None,
        max_model_len: int,
        block_size: int,
        num_kv_blocks: int,
        *,
        max_num_seqs: int | None = None,
        kv_cache_groups: Sequence[KVCacheGroup] = (),
        max_num_batched_tokens: int | None = None,
        grammar_tokenizer: Callable[[], LLTokenizer] | None = None,
    ):
        """grammar_tokenizer: structured output's llguidance tokenizer (grammar.grammar_tokenizer),
        over which a request's grammar is compiled before it is queued (None: the syntax check only).
        max_num_seqs: the scheduler's sequence slots (None: no limit checked here).
        kv_cache_groups, max_num_batched_tokens: what a sequence's blocks are counted by (one
        full-attention group and any chunk when not given: kv_cache_groups.blocks_per_sequence)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len, self.block_size, self.num_kv_blocks = max_model_len, block_size, num_kv_blocks
        self.max_num_seqs = max_num_seqs
        self.kv_cache_groups, self.max_chunk = tuple(kv_cache_groups), max_num_batched_tokens
        self.grammars = GrammarChecker(grammar_tokenizer)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_per_sequence(self.kv_cache_groups, num_tokens, self.block_size, self.max_chunk)

    def process(
        self, request_id: str, prompt: Any, params: SamplingParams, arrival_time: float | None = None
    ) -> EngineCoreRequest:
        """Tokenize and check one request; raises InvalidRequestError and changes nothing on failure."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}", "sampling_params"
            )
        self.check_samples(params)
        text, ids = self.truncate(*self.tokenize(prompt), params.truncate_prompt_tokens)  # before the length check
        self.validate_length(len(ids), params.max_tokens)
        if params.use_beam_search:
            self.check_beams_fit(len(ids), params)
        self.check_stop_token_ids(params.stop_token_ids)
        self.check_token_controls(params)
        self.grammars.check(params.structured_outputs)
        return EngineCoreRequest(
            request_id=str(request_id),
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
        )

    def check_samples(self, params: SamplingParams) -> None:
        """What SamplingParams cannot know alone: the engine's sequence slots."""
        num = params.num_samples
        name = "best_of" if params.best_of is not None else "n"
        if num > MAX_SAMPLES:
            raise InvalidRequestError(f"{name} is {num}: a request may ask for at most {MAX_SAMPLES} samples", name)
        if params.use_beam_search and self.max_num_seqs is not None and num > self.max_num_seqs:
            raise InvalidRequestError(
                f"n is {num}, but a beam search's beams run together and the engine runs at most "
                f"max_num_seqs={self.max_num_seqs} sequences at once: ask for a width of at most {self.max_num_seqs}",
                "n",
            )

    def check_beams_fit(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """A search's beams wait for each other every step, so all of them must fit in the pool at
        once even when preemption has undone their sharing: n x (prompt + max_tokens) blocks."""
        need = params.n * self.blocks_needed(num_prompt_tokens + params.max_tokens)
        if need > self.num_kv_blocks:
            raise InvalidRequestError(
                f"beam search with n={params.n} needs up to {need} KV blocks (n x (prompt {num_prompt_tokens} + "
                f"max_tokens {params.max_tokens})) but the KV cache has only {self.num_kv_blocks}",
                "n",
                CONTEXT_LENGTH_EXCEEDED,
            )

    def truncate(self, text: str | None, ids: list[int], keep: int | None) -> tuple[str | None, list[int]]:
        """truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max_model_len), all when
        None; the text is dropped when it no longer matches the ids."""
        if keep is None:
            return text, ids
        keep = self.max_model_len if keep == -1 else keep
        return (None, ids[-keep:]) if len(ids) > keep else (text, ids)

    def with_special_tokens(self, ids: list[int]) -> list[int]:
        """`ids` with the special tokens the tokenizer adds around a text (BOS, ...), as
        encode(add_special_tokens=True) would add them: found by encoding one character both ways."""
        if self.tokenizer is None:
            return ids
        plain = list(self.tokenizer.encode("a", add_special_tokens=False))
        full = list(self.tokenizer.encode("a", add_special_tokens=True))
        start = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
        if not plain or start is None:
            return ids
        return full[:start] + list(ids) + full[start + len(plain) :]

    def check_token_controls(self, params: SamplingParams) -> None:
        """logit_bias keys, allowed_token_ids and bad words' ids must be in the vocabulary; bad_words
        are tokenized into params.bad_words_token_ids here (the tokenizer is known only here)."""
        if params.bad_words:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        for name, ids in (
            ("logit_bias", list(params.logit_bias or ())),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("bad_words", [t for w in params.bad_words_token_ids or () for t in w]),
        ):
            bad = self._outside_vocabulary(ids)
            if bad is not None:
                raise InvalidRequestError(f"{name}: token id {bad} is outside {self._vocabulary()}", name)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's token ids as it starts a text and, when that tokenizes differently into
        as many tokens, after a space (mid-text): vLLM's rule, so that both forms are banned."""
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words needs a tokenizer; this engine has none", "bad_words")
        out: list[list[int]] = []
        for word in words:
            bare = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            for ids in (bare, spaced):
                if not ids or ids in out:
                    continue
                if ids is spaced and (len(spaced) != len(bare) or spaced[0] == bare[0]):
                    continue
                out.append(ids)
        if not out:
            raise InvalidRequestError("bad_words: no word has any tokens", "bad_words")
        return out

    def tokenize(self, prompt: Any, add_special_tokens: bool = False) -> tuple[str | None, list[int]]:
        """str | list[int] | {"prompt_token_ids": [...]} | {"prompt": str} -> (text, token ids).
        add_special_tokens: a text prompt gets the tokenizer's special tokens (BOS, ...)."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise InvalidRequestError(
                    f"prompt dict has unknown keys {sorted(unknown)}; use 'prompt' or 'prompt_token_ids'", "prompt"
                )
            text = prompt.get("prompt")
            if text is not None:
                self.check_text(text)
            if "prompt_token_ids" in prompt:
                return text, self.check_ids(prompt["prompt_token_ids"])
            prompt = text
        if isinstance(prompt, str):
            self.check_text(prompt)
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "prompt is a string but the engine has no tokenizer; pass token ids", "prompt"
                )
            return prompt, encode_text(self.tokenizer, prompt, add_special_tokens)
        if isinstance(prompt, (list, tuple)):
            return None, self.check_ids(prompt)
        raise InvalidRequestError(
            f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}", "prompt"
        )

    @staticmethod
    def check_text(text: Any) -> None:
        if not isinstance(text, str):
            raise InvalidRequestError(f"prompt text must be a str, got {type(text).__name__}", "prompt")
        if has_surrogate(text):
            raise InvalidRequestError("prompt contains a lone UTF-16 surrogate (U+D800..U+DFFF): not text", "prompt")

    def check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not all_ints(ids):
            raise InvalidRequestError("prompt_token_ids must be a list of integers", "prompt")
        bad = self._outside_vocabulary(ids)
        if bad is not None:
            raise InvalidRequestError(f"prompt_token_ids: token id {bad} is outside {self._vocabulary()}", "prompt")
        return list(ids)

    def check_stop_token_ids(self, ids: list[int] | None) -> None:
        """SamplingParams checked the type and sign; the vocabulary is known only here."""
        bad = self._outside_vocabulary(ids or ())
        if bad is not None:
            raise InvalidRequestError(
                f"stop_token_ids: token id {bad} is outside {self._vocabulary()}", "stop_token_ids"
            )

    def _outside_vocabulary(self, ids: Any) -> int | None:
        return first_outside(ids, TOKEN_ID_MAX + 1 if self.vocab_size is None else self.vocab_size)

    def _vocabulary(self) -> str:
        return f"the vocabulary [0, {TOKEN_ID_MAX + 1 if self.vocab_size is None else self.vocab_size})"

    def validate_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Empty prompts, prompts of max_model_len tokens or more, a prompt + max_tokens beyond
        max_model_len, and requests that could never fit in the whole KV pool are refused."""
        if num_prompt_tokens == 0:
            raise InvalidRequestError("prompt is empty: at least one token is needed", "prompt")
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {num_prompt_tokens} tokens; max_model_len is {self.max_model_len}, "
                "so at most max_model_len - 1 fit",
                "prompt",
                CONTEXT_LENGTH_EXCEEDED,
            )
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"This model's context holds {self.max_model_len} tokens, but the request asks for {total}: "
                f"{num_prompt_tokens} in the prompt and {max_tokens} for the completion. Ask for at most "
                f"{self.max_model_len - num_prompt_tokens} completion tokens, or shorten the prompt.",
                "max_tokens",
                CONTEXT_LENGTH_EXCEEDED,
            )
        need = self.blocks_needed(total)
        if need > self.num_kv_blocks:
            raise InvalidRequestError(
                f"request needs {need} KV blocks (prompt {num_prompt_tokens} + max_tokens "
                f"{max_tokens}) but the KV cache has only {self.num_kv_blocks}",
                "max_tokens",
                CONTEXT_LENGTH_EXCEEDED,
            )
