"""Incremental detokenization that never emits half of a multi-byte character.

Like vLLM: decode a short window of tokens before and after the read offset; the text the
new tokens add is the difference. A window whose text ends in U+FFFD is an incomplete UTF-8
sequence, so nothing is emitted until the next token completes it.

`fast_decoder(tokenizer)` is what both output processors' detokenizers call `.decode` on
(output_processor.py): the tokenizer's Rust backend where that gives the same text.

Per request (SamplingParams): `skip_special_tokens` (default True) leaves special tokens' text
out; with it False, `spaces_between_special_tokens` (default True) writes a space between each
special token's text and the text around it, as HF's slow tokenizers decode (`SpacedDecoder`:
the fast backend and transformers' fast decode take no such flag and never write the spaces).
"""

from __future__ import annotations

from typing import Any, Protocol

_WINDOW = 6  # tokens of left context, enough for byte-level BPE merges to settle


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class _BackendDecode:
    """`tokenizer.decode` straight from the Rust backend, skipping transformers' per-call input
    conversion (4x less time per streamed token). Used only where the two give the same text."""

    def __init__(self, backend: Any):
        self._decode = backend.decode

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text: str = self._decode(ids, skip_special_tokens=skip_special_tokens)
        return text


def fast_decoder(tokenizer: Any) -> Decoder:
    """The backend when this tokenizer does nothing more than the backend (no clean-up of
    tokenization spaces; checked on a sample of ids), else the tokenizer itself."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer  # type: ignore[no-any-return]
    fast = _BackendDecode(backend)
    try:
        n = len(tokenizer)
        sample = [list(range(i, min(n, i + 48))) for i in range(0, n, max(1, n // 16))]
        sample.append(sorted(getattr(tokenizer, "all_special_ids", []))[:8] + [0, 1, 2])
        for ids in sample:
            for skip in (True, False):
                if fast.decode(ids, skip) != tokenizer.decode(ids, skip_special_tokens=skip):
                    return tokenizer  # type: ignore[no-any-return]
    except Exception:
        return tokenizer  # type: ignore[no-any-return]
    return fast


class SpacedDecoder:
    """Decodes with special tokens kept and a space between each special token's text and its
    neighbours' (the texts of the runs between special tokens, each decoded alone, joined by " ")."""

    def __init__(self, decoder: Decoder, special_ids: frozenset[int]):
        self.decoder, self.special_ids = decoder, special_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        special = self.special_ids
        if skip_special_tokens or not any(t in special for t in ids):
            return self.decoder.decode(ids, skip_special_tokens=skip_special_tokens)
        parts: list[str] = []
        run: list[int] = []
        for t in ids:
            if t in special:
                if run:
                    parts.append(self.decoder.decode(run, skip_special_tokens=False))
                    run = []
                parts.append(self.decoder.decode([t], skip_special_tokens=False))
            else:
                run.append(t)
        if run:
            parts.append(self.decoder.decode(run, skip_special_tokens=False))
        return " ".join(parts)


def special_ids_of(tokenizer: Any) -> frozenset[int]:
    return frozenset(int(t) for t in getattr(tokenizer, "all_special_ids", ()) or ())


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def decode_all(self, output_token_ids: list[int]) -> str:
        """Non-streaming: the whole output's text in one decode (same left context as step())."""
        context = self.token_ids[: self.read_offset]
        self.text = self._decode(context + list(output_token_ids))[len(self._decode(context)) :]
        return self.text

    def flush(self) -> str:
        """At the end of the output, emit what step() still holds back (an incomplete character
        decodes as U+FFFD), so a stream's text ends the same as decode_all's."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def step(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if full_text.endswith("\ufffd") or len(full_text) < len(prefix_text):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        if self.prefix_offset > 8 * _WINDOW:  # forget tokens that can no longer matter
            self.token_ids = self.token_ids[self.prefix_offset :]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        self.text += delta
        return delta
