"""Structured output in the engine core: compiled grammars, one matcher per sequence, the step's mask.

`StructuredOutputManager` (one per EngineCore, vLLM v1's StructuredOutputManager) compiles a
request's grammar (grammar.py makes its text) into an llguidance LLMatcher on a thread pool, off
the engine loop: the request waits in the scheduler's queue until its grammar is ready and the
others are scheduled meanwhile. Compiled matchers are kept in an LRU keyed by GrammarKey, so the
same schema sent again is not compiled again (`num_compiled` counts compilations). The
llguidance tokenizer is built from the HF tokenizer on the first compilation (a factory the core
is given: the core itself has no tokenizer).

`SequenceGrammar` is one sequence's matcher, a copy of the compiled one: the scheduler advances
it with each token it resolves, copies it when a sequence forks (n > 1), keeps it across
preemption (the outputs are kept) and drops it when the sequence finishes.

`grammar_bitmask` builds a step's allowed-token mask for the constrained sample rows (the runner
calls it from ModelRunner.launch, while the step's forward runs): numpy only, the engine stays
free of torch.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par

from pagedllm.engine.grammar import GrammarKey, grammar_key, grammar_spec
from pagedllm.engine.sampling_params import SamplingParams, StructuredOutputsParams


class Seq(Protocol):
    """What `grammar_bitmask` reads of a sample row's sequence (engine/sequence.py's Sequence, which
    holds a SequenceGrammar: a protocol, so that this module does not import it back)."""

    @property
    def grammar(self) -> SequenceGrammar | None: ...

    @property
    def num_pending(self) -> int: ...

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def draft_prefix(self) -> tuple[int, ...]: ...


logger = logging.getLogger("pagedllm")

COMPILE_CACHE_SIZE = 128  # compiled grammars kept (LRU)
COMPILE_THREADS = 2  # grammars compiled at once, off the engine loop
PARALLEL_FILL_ROWS = 16  # from this many constrained rows the step's mask is filled on llguidance's threads


class StructuredOutputManager:
    def __init__(self, tokenizer_factory: Callable[[], LLTokenizer], eos_token_ids: frozenset[int]):
        """tokenizer_factory: builds the llguidance tokenizer over the model's vocabulary (logits
        width), with every EOS id of `eos_token_ids` as its EOS; called once, on a pool thread."""
        self._factory = tokenizer_factory
        self._tokenizer: LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self.eos_token_ids = eos_token_ids
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="pagedllm-grammar")
        self._cache: OrderedDict[GrammarKey, Future[LLMatcher]] = OrderedDict()
        self.executor = LLExecutor()  # llguidance's threads for the parallel mask fill
        self.num_compiled = 0  # compilations started (a cached grammar adds none)

    def grammar_for(self, so: StructuredOutputsParams) -> SequenceGrammar:
        """A matcher for a new request's first sequence; compiled in the background unless cached."""
        key = grammar_key(so)
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(self._compile, key)
            self.num_compiled += 1
            self._cache[key] = future
            while len(self._cache) > COMPILE_CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return SequenceGrammar(self, future)

    def _compile(self, key: GrammarKey) -> LLMatcher:
        matcher = LLMatcher(self.tokenizer(), grammar_spec(key), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def tokenizer(self) -> LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._factory()
            return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """The llguidance tokenizer's vocabulary (set once any grammar compiled)."""
        assert self._tokenizer is not None, "a matcher exists only after its tokenizer"
        return int(self._tokenizer.vocab_size)


class SequenceGrammar:
    """One sequence's grammar state. Until `ready`, its compilation is under way; then `matcher`
    is its own copy of the compiled matcher (made on first use), or `error` says why it failed.

    Invariant: the matcher has consumed exactly the sequence's resolved output tokens (the
    scheduler never schedules a constrained sequence with a token in flight)."""

    def __init__(
        self, manager: StructuredOutputManager, compiled: Future[LLMatcher] | None, own: LLMatcher | None = None
    ):
        self.manager = manager
        self._compiled = compiled
        self._matcher: LLMatcher | None = own

    def ready(self) -> bool:
        return self._matcher is not None or (self._compiled is not None and self._compiled.done())

    @property
    def error(self) -> str | None:
        if self._matcher is not None or self._compiled is None:
            return None
        e = self._compiled.exception()
        return None if e is None else str(e)

    @property
    def matcher(self) -> LLMatcher:
        if self._matcher is None:
            assert self._compiled is not None and self.ready(), "admitted only once compiled"
            self._matcher = self._compiled.result().deep_copy()
            self._compiled = None
        return self._matcher

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False (and the matcher in its error state) when the
        grammar does not allow it: the mask should have made that impossible."""
        m = self.matcher
        if m.consume_token(token):
            return True
        logger.error("structured output: token %d is not allowed by the grammar (%s)", token, m.get_error())
        return False

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete: nothing but EOS may follow, so the sequence ends here."""
        return bool(self.matcher.is_stopped())

    def fork(self) -> SequenceGrammar:
        """A copy for a forked sequence: the same state, advanced on its own from here."""
        return SequenceGrammar(self.manager, None, self.matcher.deep_copy())


def grammar_bitmask(sampled: Sequence[Seq], vocab_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The step's allowed tokens for its constrained sample rows: (rows [R] int64, bits
    [R, ceil(vocab_size / 32)] int32, bit j % 32 of word j // 32 set when token j may be drawn);
    None when no row is constrained. `sampled`: the step's sequences, one per sample row.

    EOS (every id of the scheduler's set) is allowed exactly when the grammar accepts here; a
    sequence with ignore_eos never draws it (it ends when its grammar is complete). Token ids
    past the tokenizer's vocabulary (a padded model vocabulary) are never allowed."""
    rows: list[tuple[int, Seq, SequenceGrammar]] = []
    for i, q in enumerate(sampled):
        if q.grammar is not None:
            assert q.num_pending == 0, "a constrained sequence is scheduled only with its last token resolved"
            rows.append((i, q, q.grammar))
    if not rows:
        return None
    manager = rows[0][2].manager  # one per engine core: every sequence's grammar comes from it
    words = (vocab_size + 31) // 32
    bits = allocate_token_bitmask(len(rows), manager.vocab_size)
    plain = [(g.matcher, k) for k, (_, q, g) in enumerate(rows) if not q.draft_prefix]
    if len(plain) >= PARALLEL_FILL_ROWS:
        fill_next_token_bitmask_par(manager.executor, plain, bits)
    else:
        for m, k in plain:
            fill_next_token_bitmask(m, bits, k)
    for k, (_, q, g) in enumerate(rows):  # a verification row: the matcher after its proposals, then back
        if q.draft_prefix:
            m = g.matcher
            ok = m.consume_tokens(list(q.draft_prefix))
            assert ok, "proposals are cut before the first token the grammar refuses (spec_decode.py)"
            fill_next_token_bitmask(m, bits, k)
            m.rollback(len(q.draft_prefix))
    if bits.shape[1] != words:  # the model's logits are wider or narrower than the tokenizer
        fit = np.zeros((len(rows), words), dtype=np.int32)
        n = min(words, bits.shape[1])
        fit[:, :n] = bits[:, :n]
        bits = fit
    ignoring = [k for k, (_, q, _) in enumerate(rows) if q.sampling_params.ignore_eos]
    if ignoring:
        u = bits.view(np.uint32)
        for t in manager.eos_token_ids:
            if t < vocab_size:
                u[ignoring, t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
    return np.array([i for i, _, _ in rows], dtype=np.int64), bits
