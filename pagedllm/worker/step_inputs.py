"""StepInputs: one step's flat arrays, built from a SchedulerOutput with numpy.

This is everything a rank needs to run the forward pass; with tensor parallelism rank 0
builds it once and ships it to the other ranks. `slot_mapping` and `block_tables` are the first
KV-cache group's; `group_tables` the others' (engine/kv_cache_groups.py). A NULL_BLOCK entry
(a block a sliding-window group gave back) becomes block 0 here: the kernels never read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedllm.engine.draft_row import DraftRow, SampleRow
from pagedllm.engine.kv_cache_groups import KVCacheGroup
from pagedllm.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedllm.worker.logits_controls import LogitsControls, TokenHistory, build_logits_controls, uses_logits_controls


@dataclass
class PromptLogprobsRows:
    """Prompt logprobs to compute for one sequence this step: hidden rows first_row ..
    first_row + len(target_ids) - 1 predict prompt tokens start, start + 1, ... whose ids are
    `target_ids`; `k` top logprobs each (SamplingParams.prompt_logprobs)."""

    seq_id: int
    first_row: int
    start: int
    k: int
    target_ids: np.ndarray  # [L] int64


@dataclass
class StepInputs:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [B, max_blocks] int32
    cu_seqlens_q: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray  # [B] int32, context length after this step
    logits_indices: np.ndarray  # [S] int64, rows of the hidden states that are sampled
    max_seqlen_q: int
    max_seqlen_k: int
    decode_only: bool
    no_history: bool
    blocks_to_copy: list[tuple[int, int]]
    # the host tier's copies (engine/host_tier.py): (GPU, host) offloads, then (host, GPU) loads
    blocks_to_offload: list[tuple[int, int]]
    blocks_to_load: list[tuple[int, int]]
    blocks_to_prefetch: list[tuple[int, int]]  # (host, GPU) loads the next step reads
    seq_ids: list[int]  # [B] the scheduled sequences, in order
    # sampling, one row per sampled sequence (only rank 0 uses these)
    sample_seq_ids: list[int]
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seeds: list[int | None]
    # min_tokens: (sample rows, token ids) to mask to -inf before sampling, two [M] int64 arrays;
    # None when no row has fewer than its min_tokens outputs (the common case costs nothing)
    min_tokens_mask: tuple[np.ndarray, np.ndarray] | None = None
    # logprobs: per sample row the top-k to return with the sampled token's logprob (None: none);
    # the list itself is None when no row asks (the common case costs nothing)
    num_logprobs: list[int | None] | None = None
    prompt_logprobs: list[PromptLogprobsRows] = field(default_factory=list)
    # (slot_mapping [T], block_tables [B, max_blocks]) of each KV-cache group after the first
    group_tables: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    # structured output: (sample rows [R] int64, allowed-token bits [R, ceil(V / 32)] int32, bit j % 32
    # of word j // 32 set when token j may be drawn; ops/token_bitmask.py); None: no row is constrained
    token_bitmask: tuple[np.ndarray, np.ndarray] | None = None
    # the sample rows' sequences when any has a grammar (else None): rank 0 fills token_bitmask from
    # them once the step's forward is queued, so the host's mask fill overlaps the device's forward
    # (ModelRunner.launch). Local to rank 0: never pickled (the other ranks do not sample).
    grammar_seqs: list[SampleRow] | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "grammar_seqs": None}

    # penalties, logit_bias, allowed_token_ids, bad words of the sample rows that use one
    # (worker/logits_controls.py); None when no row does (the common case costs nothing)
    logits_controls: LogitsControls | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def min_tokens_mask(
    sampled: list[SampleRow], eos_token_ids: frozenset[int], vocab_size: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """The ids a row may not draw yet: while a sequence has fewer than min_tokens output tokens,
    its EOS ids (unless ignore_eos) and its stop_token_ids (vLLM's min-tokens logits processor).

    Called before `Scheduler.advance`, so `num_output_tokens` counts every output token already
    drawn, pending PLACEHOLDERs included: it is the output index of the token sampled now.
    Ids outside [0, vocab_size) cannot be drawn anyway and are left out (they would index past
    the logits)."""
    rows: list[int] = []
    ids: list[int] = []
    for row, seq in enumerate(sampled):
        p = seq.sampling_params
        if seq.num_output_tokens >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            banned |= eos_token_ids
        banned = {t for t in banned if 0 <= t < vocab_size}
        rows += [row] * len(banned)
        ids += sorted(banned)
    if not rows:
        return None
    return np.array(rows, dtype=np.int64), np.array(ids, dtype=np.int64)


class BlockTableRows:
    """The scheduled sequences' block tables as arrays, kept from step to step.

    A sequence's tables (one per KV-cache group, all of one length) become one int32 array
    [groups, blocks] with NULL_BLOCK entries as block 0 (never read). It is rebuilt only when the
    KV-cache manager changed a table (`Sequence.block_tables_version`): a decode step changes a
    sequence's tables once every block_size tokens, so most steps copy one array per sequence
    instead of converting each group's list. Entries of sequences not scheduled in a step are dropped."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[int, np.ndarray]] = {}  # seq_id -> (block_tables_version, rows)
        # the last call's sequences (in order) and its result: a step that schedules the same sequences
        # in the same order (most decode steps) patches the rows that changed instead of copying all
        self._ids: list[int] = []
        self._last: np.ndarray | None = None

    @staticmethod
    def _row(seq, num_groups: int) -> np.ndarray:
        arr = np.array(seq.block_tables, dtype=np.int32).reshape(num_groups, -1)
        np.maximum(arr, 0, out=arr)  # NULL_BLOCK (-1) -> 0: never read
        return arr

    def tables(self, sched: list, num_groups: int) -> np.ndarray:
        """[groups, B, max_blocks] int32, row i the i-th scheduled sequence's tables, zero-padded
        (at least as wide as the longest; a patched step keeps the last step's width)."""
        seqs = [s.seq for s in sched]
        ids = [q.seq_id for q in seqs]
        if ids == self._ids and self._last is not None and self._last.shape[0] == num_groups:
            patched = self._patch(seqs, num_groups, self._last)
            if patched is not None:
                return patched.copy()
        kept: dict[int, tuple[int, np.ndarray]] = {}
        rows = []
        for seq in seqs:
            entry = self.rows.get(seq.seq_id)
            if entry is None or entry[0] != seq.block_tables_version:
                entry = (seq.block_tables_version, self._row(seq, num_groups))
            kept[seq.seq_id] = entry
            rows.append(entry[1])
        self.rows = kept
        tables = np.zeros((num_groups, len(seqs), max(r.shape[1] for r in rows)), dtype=np.int32)
        for i, r in enumerate(rows):
            tables[:, i, : r.shape[1]] = r
        self._ids, self._last = ids, tables
        return tables.copy()

    def _patch(self, seqs: list, num_groups: int, tables: np.ndarray) -> np.ndarray | None:
        """Rewrite, in the last result, the rows of the sequences whose tables changed; None when a
        row no longer fits its width (the caller rebuilds)."""
        width = tables.shape[2]
        for i, seq in enumerate(seqs):
            version, _ = self.rows[seq.seq_id]
            if version == seq.block_tables_version:
                continue
            arr = self._row(seq, num_groups)
            if arr.shape[1] > width:
                return None
            tables[:, i, : arr.shape[1]] = arr
            tables[:, i, arr.shape[1] :] = 0
            self.rows[seq.seq_id] = (seq.block_tables_version, arr)
        return tables


def build_step_inputs(
    out: SchedulerOutput,
    block_size: int,
    vocab_size: int,
    eos_token_ids: frozenset[int],
    groups: tuple[KVCacheGroup, ...] = (),
    table_rows: BlockTableRows | None = None,
    history: TokenHistory | None = None,
) -> StepInputs:
    """eos_token_ids: the scheduler's own set (what ends a sequence), masked for min_tokens.
    groups: the model's KV-cache groups (one full-attention group when empty); table_rows: the caller's
    BlockTableRows, kept across its steps (None: built afresh); history: the caller's TokenHistory for
    the penalties and bad words, kept across its steps alike."""
    sched = out.scheduled
    n_new_l, start_l, num_tokens_l, seq_ids = [], [], [], []
    multi_row = prompt_lp = False  # any sequence with several sample rows (forks, proposals); any scoring its prompt
    for s in sched:  # one pass: at 256 sequences the per-sequence Python is most of this function's time
        q = s.seq
        n_new_l.append(s.num_new_tokens)
        start_l.append(q.num_computed_tokens)
        num_tokens_l.append(q.num_tokens + len(s.spec_token_ids))
        seq_ids.append(q.seq_id)
        if s.forks or s.spec_token_ids:
            multi_row = True
        if q.needs_prompt_logprobs:
            prompt_lp = True
    n_new = np.array(n_new_l, dtype=np.int64)
    start = np.array(start_l, dtype=np.int64)
    end = start + n_new
    cu = np.zeros(len(sched) + 1, dtype=np.int32)
    np.cumsum(n_new, out=cu[1:])
    total = int(cu[-1])
    # positions: for each sequence, start..end-1, concatenated (vectorised, no per-token loop)
    seq_of_token = np.repeat(np.arange(len(sched)), n_new)
    positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), n_new) + np.repeat(start, n_new)
    decode_only = bool((n_new == 1).all())
    if decode_only:
        input_ids = np.fromiter((s.seq.token_ids[-1] for s in sched), dtype=np.int64, count=len(sched))
    else:
        input_ids = np.concatenate(
            [
                np.asarray(s.seq.token_ids[a:b] if not s.spec_token_ids else [*s.seq.token_ids[a:], *s.spec_token_ids])
                for s, a, b in zip(sched, start.tolist(), end.tolist(), strict=False)
            ]
        ).astype(np.int64, copy=False)
    tables = (table_rows or BlockTableRows()).tables(sched, max(1, len(groups)))
    slots = tables[:, seq_of_token, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size  # [groups, T]
    slot_mapping, block_tables = slots[0], tables[0]
    group_tables = [(slots[g], tables[g]) for g in range(1, len(tables))]
    samples = end == np.array(num_tokens_l, dtype=np.int64)
    logits_indices = (cu[1:][samples] - 1).astype(np.int64)
    sampled: list[SampleRow] = [s.seq for s, keep in zip(sched, samples.tolist(), strict=True) if keep]
    if multi_row:  # several sample rows for one scheduled sequence
        rows = [row for i, s in enumerate(sched) if samples[i] for row in _sample_rows(s, int(cu[i + 1]) - 1)]
        sampled = [q for q, _ in rows]
        logits_indices = np.array([r for _, r in rows], dtype=np.int64)
    cols = SamplingColumns(sampled, vocab_size)
    controls = None
    if cols.any_controls:
        controls = build_logits_controls(sampled, vocab_size, history or TokenHistory())
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        cu_seqlens_q=cu,
        seq_lens=end.astype(np.int32),
        logits_indices=logits_indices,
        max_seqlen_q=int(n_new.max()),
        max_seqlen_k=int(end.max()),
        decode_only=decode_only,
        no_history=bool((start == 0).all()),
        blocks_to_copy=list(out.blocks_to_copy),
        blocks_to_offload=list(out.blocks_to_offload),
        blocks_to_load=list(out.blocks_to_load),
        blocks_to_prefetch=list(out.blocks_to_prefetch),
        seq_ids=seq_ids,
        sample_seq_ids=cols.seq_ids,
        temperature=np.array(cols.temperature, dtype=np.float32),
        top_k=np.array(cols.top_k, dtype=np.int64),
        top_p=np.array(cols.top_p, dtype=np.float32),
        min_p=np.array(cols.min_p, dtype=np.float32),
        seeds=cols.seeds,
        min_tokens_mask=min_tokens_mask(sampled, eos_token_ids, vocab_size) if cols.any_min_tokens else None,
        num_logprobs=cols.num_logprobs if cols.any_logprobs else None,
        prompt_logprobs=prompt_logprobs_rows(sched, cu, start, end) if prompt_lp else [],
        group_tables=group_tables,
        grammar_seqs=sampled if cols.any_grammar else None,
        logits_controls=controls,
    )


class SamplingColumns:
    """The sample rows' sampling parameters as columns, and what any row asks for, in one pass over
    the rows (build_step_inputs; at 256 rows one loop costs less than a generator per column)."""

    def __init__(self, sampled: list[SampleRow], vocab_size: int):
        self.seq_ids: list[int] = []
        self.temperature: list[float] = []
        self.top_k: list[int] = []
        self.top_p: list[float] = []
        self.min_p: list[float] = []
        self.seeds: list[int | None] = []
        self.num_logprobs: list[int | None] = []
        self.any_min_tokens = self.any_logprobs = self.any_controls = self.any_grammar = False
        for q in sampled:
            p = q.sampling_params
            self.seq_ids.append(q.seq_id)
            self.temperature.append(p.temperature)
            # top_k at or above the vocabulary is off: clamped to it in Python (SamplingParams bounds it by 2**31 - 1)
            self.top_k.append(min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size)
            self.top_p.append(p.top_p)
            self.min_p.append(p.min_p)
            self.seeds.append(p.seed)
            k = q.num_logprobs
            self.num_logprobs.append(k)
            if k is not None:
                self.any_logprobs = True
            if p.min_tokens:
                self.any_min_tokens = True
            if not self.any_controls and uses_logits_controls(p):
                self.any_controls = True
            if q.grammar is not None:
                self.any_grammar = True


def _sample_rows(s: ScheduledSequence, last: int) -> list[tuple[SampleRow, int]]:
    """(row, hidden index) of a sampling sequence: parallel sampling draws once per child from its
    last row; a verification step (spec_verify.py) draws from its last 1 + k' rows, row j as if
    its first j proposals were its output (draft_row.py)."""
    drafts = s.spec_token_ids
    if not drafts:
        return [(q, last) for q in s.sample_seqs]
    k = len(drafts)
    return [(s.seq, last - k)] + [(DraftRow(s.seq, tuple(drafts[:j])), last - k + j) for j in range(1, k + 1)]


def prompt_logprobs_rows(sched: list, cu: np.ndarray, start: np.ndarray, end: np.ndarray) -> list[PromptLogprobsRows]:
    """The rows of this step that score prompt tokens: the hidden state at position p predicts
    token p + 1, for the prompt tokens the sequence has no logprobs for yet (a resumed sequence
    recomputes rows it has)."""
    out: list[PromptLogprobsRows] = []
    for i, s in enumerate(sched):
        seq = s.seq
        if not seq.needs_prompt_logprobs:
            continue
        a, b = int(start[i]), int(end[i])
        lo = max(a + 1, len(seq.prompt_logprobs) + 1)  # first prompt token to score
        hi = min(b, seq.num_prompt_tokens - 1)  # last: position b - 1 predicts token b
        if lo > hi:
            continue
        k = seq.sampling_params.prompt_logprobs
        assert k is not None
        targets = np.asarray(seq.token_ids[lo : hi + 1], dtype=np.int64)
        out.append(PromptLogprobsRows(seq.seq_id, int(cu[i]) + lo - 1 - a, lo, k, targets))
    return out
