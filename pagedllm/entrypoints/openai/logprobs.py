"""Logprobs in OpenAI's response shapes, from the engine's (engine/outputs.py: one dict
token id -> Logprob per position, the position's own token first, then the top k).

/v1/completions (`completion_logprobs`): per choice `{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}`, one entry per token. `tokens` are each token's own text;
`top_logprobs` maps text -> logprob over every entry of the position (the token and the top k,
so up to k + 1 keys, as OpenAI's legacy API); `text_offset` is where the token's text starts,
the running sum of the previous tokens' text lengths (a stream continues it chunk to chunk, so
the chunks' lists joined equal the non-streamed ones). A position without an entry (the first
prompt token under `echo`) has null `token_logprobs` and `top_logprobs`.

/v1/chat/completions (`chat_logprobs`): `[{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}]}]`, `top_logprobs` the k most likely, best first.

-inf (a token the raw logits rule out) is written as -9999.0, OpenAI's stand-in: JSON has no
infinity.

`as_ids` (vLLM's return_tokens_as_token_ids): every token is written "token_id:N" instead of its
text, so a token whose text is not valid UTF-8 alone can still be identified.

`prompt_logprobs_json`: vLLM's `prompt_logprobs` answer field, one item per prompt token: null
for the first, then {token id (a string key): {"logprob", "rank", "decoded_token"}}.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedllm.engine.outputs import Logprob

LOGPROB_FLOOR = -9999.0
Entry = dict[int, Logprob] | None  # one position: None when it has no logprobs (the first prompt token)
TokenText = Callable[[int], str]  # a token id's own text, for entries that carry none


def _value(lp: Logprob) -> float:
    return max(lp.logprob, LOGPROB_FLOOR)


def _text(token_id: int, lp: Logprob | None, decode: TokenText, as_ids: bool = False) -> str:
    if as_ids:
        return f"token_id:{token_id}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return decode(token_id)


def entries_of(logprobs: Sequence[Entry] | None, num_tokens: int) -> list[Entry]:
    """The last `num_tokens` entries (a stream's new tokens), or Nones when there are none."""
    if not num_tokens:
        return []
    if logprobs is None:
        return [None] * num_tokens
    tail = list(logprobs[-num_tokens:])
    return [None] * (num_tokens - len(tail)) + tail


def completion_logprobs(
    token_ids: Sequence[int], entries: Sequence[Entry], decode: TokenText, offset: int = 0, as_ids: bool = False
) -> tuple[dict[str, Any], int]:
    """(the `logprobs` object of a completion choice, the text offset after its last token).
    `entries` has one entry (or None) per token."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        own = entry.get(token_id) if entry is not None else None
        text = _text(token_id, own, decode, as_ids)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(None if own is None else _value(own))
        top_logprobs.append({_text(t, lp, decode, as_ids): _value(lp) for t, lp in entry.items()})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }, offset


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[Entry], top: int, decode: TokenText, as_ids: bool = False
) -> list[dict[str, Any]]:
    """The `logprobs.content` list of a chat choice: one item per token, each with its `top` best."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        own = entry.get(token_id) if entry is not None else None
        item = _chat_token(_text(token_id, own, decode, as_ids), LOGPROB_FLOOR if own is None else _value(own))
        best = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top] if entry is not None and top else []
        item["top_logprobs"] = [_chat_token(_text(t, lp, decode, as_ids), _value(lp)) for t, lp in best]
        content.append(item)
    return content


def prompt_logprobs_json(
    entries: Sequence[Entry] | None, decode: TokenText, as_ids: bool = False
) -> list[dict[str, dict[str, Any]] | None] | None:
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": _value(lp), "rank": lp.rank, "decoded_token": _text(t, lp, decode, as_ids)}
            for t, lp in entry.items()
        }
        for entry in entries
    ]
