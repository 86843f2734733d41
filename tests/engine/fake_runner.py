"""A fake model runner with a shadow KV cache, for testing the control plane without torch.

It writes (position, token) into slot = block_table[p // bs] * bs + p % bs for every new
token, then reads the whole context back through the block table. The next token is a
hash of what it read back, so a wrong slot, a wrongly shared block or a wrong prefix hit
changes the output.
"""

from __future__ import annotations

import zlib

from pagedllm.engine.scheduler import PLACEHOLDER, SchedulerOutput
from pagedllm.engine.sequence import Sequence

VOCAB = 97


def next_token(context: list) -> int:
    return zlib.crc32(repr(context).encode()) % VOCAB


def drain(engine) -> dict:
    """Step an LLMEngine until nothing is unfinished: request id -> its final RequestOutput."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def reference_generate(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = next_token([(p, tok) for p, tok in enumerate(tokens)])
        tokens.append(t)
        out.append(t)
    return out


class ShadowRunner:
    """An Executor (engine/executor.py). The shadow cache is a dict, so any pool size fits:
    num_kv_blocks reports what the test asks for. supports_async=False makes the engine
    drive it with execute only."""

    def __init__(self, block_size: int, num_kv_blocks: int = 1 << 16, supports_async: bool = True):
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.supports_async = supports_async
        self.closed = False
        self.shadow: dict[int, tuple[int, int]] = {}
        self.device_tokens: dict[tuple[int, int], int] = {}
        self.steps = 0
        self.decode_and_prefill_mixed = 0

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, out: SchedulerOutput) -> list[int]:
        self.steps += 1
        bs = self.block_size
        for src, dst in out.blocks_to_copy:
            for off in range(bs):
                if src * bs + off in self.shadow:
                    self.shadow[dst * bs + off] = self.shadow[src * bs + off]
        kinds = set()
        for s in out.scheduled:
            seq = s.seq
            kinds.add(s.num_new_tokens == 1 and seq.num_computed_tokens > 0)
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + s.num_new_tokens):
                token = seq.token_ids[pos]
                if token == PLACEHOLDER:  # async scheduling: the id lives "on the device"
                    token = self.device_tokens[(seq.seq_id, pos)]
                self.shadow[self.slot(seq, pos)] = (pos, token)
        if len(kinds) == 2:
            self.decode_and_prefill_mixed += 1
        sampled = []
        for s in out.scheduled:
            if s.samples:
                seq = s.seq
                ctx = [self.shadow.get(self.slot(seq, p)) for p in range(seq.num_tokens)]
                sampled.append(next_token(ctx))
                self.device_tokens[(seq.seq_id, seq.num_tokens)] = sampled[-1]
        return sampled

    def execute_async(self, out: SchedulerOutput) -> Done:
        """Like a GPU launch: the work happens in launch order; the ids come back later."""
        assert self.supports_async, "execute_async called on an executor without supports_async"
        return Done(self.execute(out))

    def close(self) -> None:
        self.closed = True


class Done:
    def __init__(self, value: list[int]):
        self.value = value

    def result(self) -> list[int]:
        return self.value


class CharTokenizer:
    """One token per character code (mod VOCAB is not applied: test prompts stay ASCII < 97)."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 32 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i + 32) for i in ids)
