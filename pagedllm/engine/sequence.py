"""A Sequence is one stream of tokens the engine generates; its KV lives in its block tables."""

from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING

from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.step_result import TokenLogprobs

if TYPE_CHECKING:
    from pagedllm.engine.beam_search import BeamSearch
    from pagedllm.engine.structured_output import SequenceGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the request could not run (its grammar failed to compile in the core)

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_ERROR,
    }
)
_seq_counter = itertools.count()


class Sequence:
    """Token ids, the number of them whose KV is in the cache, and the block table holding it.

    Invariant: num_computed_tokens <= num_tokens; each block table covers num_computed_tokens
    (plus the tokens scheduled this step). One table per KV-cache group (kv_cache_groups.py), all
    of one length; a sliding-window group's table has NULL_BLOCK entries for the blocks it gave
    back. The last token is never computed until it is scheduled, so a step that completes the
    sequence's tokens yields a sampled next token.

    Parallel sampling: the first sequence of a request with n > 1 holds the others in `forks`
    until the step that computes its prompt's last token is scheduled; there the scheduler forks
    them (they share every block by reference count, `fork_parent` is cleared) and each samples
    its own first token from that step's logits. Until then a child is WAITING in no queue.
    """

    draft_prefix: tuple[int, ...] = ()  # as a sample row: no proposals before it (draft_row.py)

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
    ):
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        # its next logits depend on its past tokens' ids (penalties, a grammar, a bad word of several
        # tokens): under async scheduling it waits for a token in flight (scheduler.py)
        self.needs_history = sampling_params.needs_output_history
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # nano-vllm calls it num_cached_tokens
        self.num_cached_tokens = 0  # prefix-cache hit at the first admission (vLLM's name), never reset
        self.num_preemptions = 0  # times preempted (vLLM's name): > 0 makes an admission a resume
        # per KV-cache group (the manager makes one per group when it first gives blocks)
        self.block_tables: list[list[int]] = [[]]
        self.chain_prefix_ids: list[int | None] = [None]  # the prefix id the group's next block follows
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks (block_pool.BlockHash), lazily extended
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.kv_forked = False  # shares blocks by a fork (only then can a partly filled block be shared)
        self.block_tables_version = 0  # bumped by the KV-cache manager whenever a table changes
        self.forks: list[Sequence] = []  # children forked when this sequence samples its first token
        self.fork_parent: Sequence | None = None  # set while this child waits in its parent's forks
        self.prompt_logprobs: list[TokenLogprobs] = []  # scored prompt tokens so far (SamplingParams.prompt_logprobs)
        self.num_logprobs: int | None = sampling_params.logprobs  # top-k the sampler returns per token
        # beam search: the request's search, and this beam's top-k of the step that computed its
        # last token, kept until every beam of the request has one (then the search steps)
        self.beam: BeamSearch[Sequence] | None = None
        self.beam_result: TokenLogprobs | None = None
        self.num_pending = 0  # trailing PLACEHOLDER tokens (async scheduling)
        # structured output: the grammar its output must match (structured_output.py); None: free
        self.grammar: SequenceGrammar | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.stop_reason: int | str | None = None
        self.stopped_on_token = False  # finished by an EOS or stop token id (its text is not shown)

    @property
    def block_table(self) -> list[int]:
        """The first KV-cache group's table: the only one of a model whose layers are of one kind."""
        return self.block_tables[0]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed: the prompt must be run, not hit in the cache."""
        return (
            self.sampling_params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    @property
    def num_resolved_output_tokens(self) -> int:
        """Output tokens whose ids are known (not PLACEHOLDERs of a step still on the device)."""
        return len(self.token_ids) - self.num_pending - self.num_prompt_tokens

    @property
    def last_resolved_token(self) -> int:
        return self.token_ids[len(self.token_ids) - self.num_pending - 1]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def fork_child(self) -> Sequence:
        """A new sequence of the same request with this one's tokens and prompt split (beam
        search); its blocks come from KVCacheManager.fork."""
        child = Sequence(self.request_id, self.prompt_token_ids, self.sampling_params, self.arrival_time)
        child.token_ids = list(self.token_ids)
        child.num_cached_tokens = self.num_cached_tokens
        child.first_token_time = self.first_token_time
        child.num_logprobs, child.beam = self.num_logprobs, self.beam
        child.status = self.status
        return child  # (a new seq_id: nothing cached for its tables)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={self.block_tables})"
        )
