"""A fake model runner with a shadow KV cache, for testing the control plane without torch.

It writes (position, token) into slot = block_table[p // bs] * bs + p % bs for every new
token, then reads the whole context back through the block table. The next token is a
hash of what it read back, so a wrong slot, a wrongly shared block or a wrong prefix hit
changes the output.

With KV-cache groups (`windows`: one entry per group, None for full attention, W for a
sliding window), every group has its own block tables: the runner writes (group, position,
token) through each group's table and reads back, per group, what its layers attend to: the
whole context, or the last W positions. A block given back while still inside a window, or
shared across groups, changes the output.

Host tier (engine/host_tier.py): `host_shadow` is the host buffer. A step's offloads copy GPU
slots there, its loads copy them back (in that order, before its copy-on-write copies and its
tokens), and every loaded block is checked at once against the tokens of the sequence that
loads it: a load of the wrong host block, or of one whose offload never ran, fails the step.
"""

from __future__ import annotations

import zlib

from pagedllm.engine.kv_cache_groups import KVCacheGroup
from pagedllm.engine.scheduler import PLACEHOLDER, SchedulerOutput
from pagedllm.engine.sequence import Sequence
from pagedllm.engine.step_result import PromptLogprobsChunk, StepResult, TokenLogprobs

VOCAB = 97


def next_token(context: list) -> int:
    return zlib.crc32(repr(context).encode()) % VOCAB


def copy_token(context: list, period: int) -> int:
    """A copy-heavy rule (speculative decoding's tests): mostly the token read back `period`
    positions ago, else (one time in four, and while there is none) the context's hash; either way
    a function of what was read back, so wrong KV still changes the output."""
    h = zlib.crc32(repr(context).encode())
    if len(context) >= period and h % 4 and context[-period] is not None:
        return context[-period][-1]
    return h % VOCAB


def drain(engine) -> dict:
    """Step an LLMEngine until nothing is unfinished: request id -> its final RequestOutput."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def fake_logprobs(token: int, k: int, context: list) -> TokenLogprobs:
    """What the fake reports for `token` drawn (or scored) after `context`: deterministic, and a
    function of both, so a logprob attached to the wrong token or row shows."""
    base = next_token([*context, ("lp", token)])
    top = [(base + j) % VOCAB for j in range(k)]
    offset = (base % 89) / 100.0  # the top k's values differ between contexts (beam search ranks across rows)
    return TokenLogprobs([token, *top], [-(base % 13) / 4.0] + [-(j + offset) / 8.0 for j in range(k)], 1 + base % 5)


def windowed_context(tokens: list, windows: tuple[int | None, ...]) -> list:
    """What a ShadowRunner with groups reads back before sampling after `tokens`."""
    n = len(tokens)
    return [[(g, p, tokens[p]) for p in range(n if w is None else max(0, n - w), n)] for g, w in enumerate(windows)]


def reference_generate(
    prompt: list[int],
    max_tokens: int,
    seed: int | None = None,
    windows: tuple[int | None, ...] | None = None,
    copy_period: int | None = None,
) -> list[int]:
    """What ShadowRunner samples for a request alone (seed: with salt_by_seed=True; windows: its
    groups'; copy_period: with its copy rule)."""
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        ctx: list = [(p, tok) for p, tok in enumerate(tokens)] if windows is None else windowed_context(tokens, windows)
        ctx = ctx if seed is None else [*ctx, ("seed", seed)]
        t = next_token(ctx) if copy_period is None else copy_token(ctx, copy_period)
        tokens.append(t)
        out.append(t)
    return out


class ShadowRunner:
    """An Executor (engine/executor.py). The shadow cache is a dict, so any pool size fits:
    num_kv_blocks reports what the test asks for. supports_async=False makes the engine
    drive it with execute only. salt_by_seed=True mixes a seeded row's seed into its token, so
    the children of a forked row (seeds seed + i) draw different tokens from the same context.
    Rows and prompts that ask for logprobs get `fake_logprobs`. copy_period: draw with
    `copy_token` (copy-heavy output, so n-gram proposals are often accepted). A verification
    step's proposals (ScheduledSequence.spec_token_ids) are written after the last token and each
    of its rows reads back the context up to its own position."""

    def __init__(
        self,
        block_size: int,
        num_kv_blocks: int = 1 << 16,
        supports_async: bool = True,
        salt_by_seed: bool = False,
        windows: tuple[int | None, ...] | None = None,
        copy_period: int | None = None,
    ):
        self.block_size = block_size
        self.copy_period = copy_period
        self.windows = windows
        # one group per window, of one made-up layer each (the layers do not matter to the fake)
        self.kv_cache_groups = tuple(KVCacheGroup((g,), w) for g, w in enumerate(windows or (None,)))
        self.salt_by_seed = salt_by_seed
        self.num_kv_blocks = num_kv_blocks
        self.kv_cache_dtype = "float32"  # the Executor protocol: nothing is stored, any name will do
        self.supports_async = supports_async
        self.closed = False
        self.shadow: dict[int, tuple[int, ...]] = {}  # slot -> (position, token) or (group, position, token)
        self.host_shadow: dict[int, tuple[int, ...]] = {}  # host slot -> what the GPU slot held
        self.num_loaded_blocks = 0
        self.num_prefetched_blocks = 0
        self.prefetched: set[int] = set()  # GPU blocks the last step prefetched
        self.device_tokens: dict[tuple[int, int], int] = {}
        self.steps = 0
        self.decode_and_prefill_mixed = 0

    def slot(self, seq: Sequence, pos: int, group: int = 0) -> int:
        block = seq.block_tables[group][pos // self.block_size]
        assert block >= 0, (seq, group, pos)  # a NULL_BLOCK entry is never read or written
        return block * self.block_size + pos % self.block_size

    def _context(self, seq: Sequence, n: int | None = None) -> list:
        n = seq.num_tokens if n is None else n
        if self.windows is None:
            return [self.shadow.get(self.slot(seq, p)) for p in range(n)]
        return [
            [self.shadow.get(self.slot(seq, p, g)) for p in range(n if w is None else max(0, n - w), n)]
            for g, w in enumerate(self.windows)
        ]

    def _copy(self, src: dict, s: int, dst: dict, d: int) -> None:
        bs = self.block_size
        for off in range(bs):
            value = src.get(s * bs + off)
            if value is None:
                dst.pop(d * bs + off, None)
            else:
                dst[d * bs + off] = value

    def _check_loads(self, out: SchedulerOutput, loaded: set[int], all_read: bool = True) -> None:
        """Every loaded block a scheduled sequence reads holds exactly the KV of the tokens its table
        position names; all_read: every one of them is read (loads for this step)."""
        seen = set()
        for s in out.scheduled:
            seq = s.seq
            for g, table in enumerate(seq.block_tables):
                for i, block in enumerate(table):
                    if block not in loaded or (not all_read and (i + 1) * self.block_size > seq.num_computed_tokens):
                        continue  # (a block prefetched last step may have been evicted and be written now)
                    seen.add(block)
                    span = range(i * self.block_size, (i + 1) * self.block_size)
                    want = [(p, seq.token_ids[p]) if self.windows is None else (g, p, seq.token_ids[p]) for p in span]
                    got = [self.shadow.get(block * self.block_size + j) for j in range(self.block_size)]
                    assert got == want, (seq.seq_id, g, i, block, got, want)
        assert seen == loaded or not all_read, loaded - seen  # a load no scheduled sequence reads

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.steps += 1
        bs = self.block_size
        for gpu, host in out.blocks_to_offload:
            self._copy(self.shadow, gpu, self.host_shadow, host)
        for host, gpu in out.blocks_to_load:
            self._copy(self.host_shadow, host, self.shadow, gpu)
        if out.blocks_to_load:
            self.num_loaded_blocks += len(out.blocks_to_load)
            self._check_loads(out, {gpu for _, gpu in out.blocks_to_load})
        if self.prefetched:  # the last step's prefetch, read from this step on
            self._check_loads(out, self.prefetched, all_read=False)
        # a prefetch runs beside the forward: no sequence of this step may hold its blocks (here the
        # copies land after the forward, so a read of one would see the block's old KV)
        prefetch = {gpu for _, gpu in out.blocks_to_prefetch}
        assert not any(prefetch.intersection(t) for s in out.scheduled for t in s.seq.block_tables), prefetch
        for src, dst in out.blocks_to_copy:
            for off in range(bs):
                if src * bs + off in self.shadow:
                    self.shadow[dst * bs + off] = self.shadow[src * bs + off]
        kinds = set()
        for s in out.scheduled:
            seq = s.seq
            kinds.add(s.num_new_tokens == 1 and seq.num_computed_tokens > 0)
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + s.num_new_tokens):
                token = seq.token_ids[pos] if pos < seq.num_tokens else s.spec_token_ids[pos - seq.num_tokens]
                if token == PLACEHOLDER:  # async scheduling: the id lives "on the device"
                    token = self.device_tokens[(seq.seq_id, pos)]
                if self.windows is None:
                    self.shadow[self.slot(seq, pos)] = (pos, token)
                else:
                    for g in range(len(self.windows)):
                        self.shadow[self.slot(seq, pos, g)] = (g, pos, token)
        if len(kinds) == 2:
            self.decode_and_prefill_mixed += 1
        sampled: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        prompt: dict[int, PromptLogprobsChunk] = {}
        for s in out.scheduled:
            seq = s.seq
            k = seq.sampling_params.prompt_logprobs
            if k is not None and seq.needs_prompt_logprobs:
                self._prompt_logprobs(s, k, prompt)
            if not s.samples:
                continue
            for j in range(len(s.spec_token_ids) + 1):
                ctx = self._context(seq, seq.num_tokens + j)
                for q in s.sample_seqs:
                    seed = q.sampling_params.seed
                    salted = ctx if seed is None or not self.salt_by_seed else [*ctx, ("seed", seed)]
                    token = next_token(salted) if self.copy_period is None else copy_token(salted, self.copy_period)
                    sampled.append(token)
                    self.device_tokens[(q.seq_id, seq.num_tokens)] = token
                    num = q.num_logprobs
                    logprobs.append(None if num is None else fake_logprobs(token, num, ctx))
        for host, gpu in out.blocks_to_prefetch:
            self._copy(self.host_shadow, host, self.shadow, gpu)
        self.prefetched = prefetch
        self.num_prefetched_blocks += len(prefetch)
        has_logprobs = any(x is not None for x in logprobs)
        return StepResult(sampled, logprobs if has_logprobs else None, prompt or None)

    def _prompt_logprobs(self, s, k: int, into: dict[int, PromptLogprobsChunk]) -> None:
        """Score the prompt tokens this chunk predicts that the sequence has no logprobs for yet."""
        seq = s.seq
        a, b = seq.num_computed_tokens, seq.num_computed_tokens + s.num_new_tokens
        lo, hi = max(a + 1, len(seq.prompt_logprobs) + 1), min(b, seq.num_prompt_tokens - 1)
        if lo <= hi:
            entries = [fake_logprobs(seq.token_ids[t], k, list(seq.token_ids[:t])) for t in range(lo, hi + 1)]
            into[seq.seq_id] = PromptLogprobsChunk(lo, entries)

    def execute_async(self, out: SchedulerOutput) -> Done:
        """Like a GPU launch: the work happens in launch order; the ids come back later."""
        assert self.supports_async, "execute_async called on an executor without supports_async"
        return Done(self.execute(out))

    def close(self) -> None:
        self.closed = True


class Done:
    def __init__(self, value: StepResult):
        self.value = value

    def result(self) -> StepResult:
        return self.value


class CharTokenizer:
    """One token per character code (mod VOCAB is not applied: test prompts stay ASCII < 97)."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 32 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i + 32) for i in ids)
