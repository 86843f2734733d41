"""The draft model of draft-model speculative decoding (engine/spec_draft.py): its own weights, its
own KV tensor, and the forwards that propose.

The draft's KV tensor has the target pool's block count and block size, so the target's block
tables and slot mappings index it unchanged: no block ids of its own. It runs only in a step that
verifies proposals, and only for the sequences that do, lazily:

- a "catch-up" forward over the tokens of the sequence whose draft KV is not written yet, up to
  and including its last token (at position P, written by this step): after a verification step
  usually one or two tokens; after steps without proposals (a pause, a batch above
  disable_by_batch_size) what it missed; for a new sequence (a fork, a prefix-cache or host-tier
  hit) or one preempted since, everything from position 0 (its blocks are not the ones the draft
  wrote, or were freed). In forwards of at most max_num_batched_tokens tokens; the last row of
  the last gives d_1 (argmax);
- then k' single-token forwards: d_j at position P + j writes its KV and (j < k') gives d_{j+1}.

What is written is remembered per sequence (`_written`: the count, and the sequence's
num_preemptions then), cut back to the target's computed tokens when read: verification's rollback
gives rejected proposals' slots back, so the positions of rejected proposals are rewritten by the
next catch-up. So whenever the draft proposes, every position before the last token holds the
draft's KV of the sequence's own tokens; copy-on-write copies of a step run on both tensors. A step
without proposals costs the draft nothing.

With CUDA graphs, the forwards of one token per sequence (the k' forwards, and a catch-up of one
token each) replay the draft's own decode graphs (worker/draft_graphs.py); longer catch-ups run
eagerly. The draft is greedy, with the target's dtype and its own KV in that dtype (never fp8: no
scales to choose). Tensor parallelism is refused at start-up (entrypoints/draft_check.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from pagedllm.engine.scheduler_output import SchedulerOutput
from pagedllm.model.loader import init_dummy_weights, load_weights
from pagedllm.model.registry import build_model
from pagedllm.ops.kernels import kernels_for
from pagedllm.worker.cuda_graphs import DecodeGraphs
from pagedllm.worker.device import GiB, check_kernel_shapes
from pagedllm.worker.draft_graphs import DraftGraphView, DraftRows, draft_batch_limit, replay
from pagedllm.worker.kv_cache import allocate_kv_cache, block_bytes, groups_of
from pagedllm.worker.step_inputs import BlockTableRows

if TYPE_CHECKING:
    from pagedllm.ops.attention_metadata import AttentionMetadata

logger = logging.getLogger("pagedllm")


@dataclass(frozen=True)
class DraftSpec:
    """What the runner needs to build the draft: its checked config and directory (draft_check.py)."""

    hf_config: Any
    model_dir: str
    max_batch: int | None = None  # the most sequences a step proposes for (disable_by_batch_size; None: any)


class DraftHost(Protocol):
    """What the draft reads of the model runner that owns it (worker/model_runner.py)."""

    device: torch.device
    block_size: int
    max_num_batched_tokens: int  # the most tokens one catch-up forward takes (as a target step)

    def _to_device(self, a: np.ndarray) -> torch.Tensor: ...

    def _metadata_from(
        self, *, slot_mapping, block_tables, cu, seq_lens, max_q, max_k, decode_only, no_history, groups=(), extra=()
    ) -> tuple[AttentionMetadata, list[torch.Tensor]]: ...

    def _copy_blocks(self, kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None: ...


class DraftModel:
    MAX_TRACKED = 65536  # sequences whose draft KV is remembered (a dropped live one catches up from 0)

    def __init__(
        self,
        spec: DraftSpec,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        load_format: str,
        seed: int,
    ):
        """load_format "dummy": seeded random weights (the target's seed: the target as its own draft
        gets the target's very weights)."""
        self.device, self.dtype = device, dtype
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = build_model(spec.hf_config, kernels_for(device), max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        if load_format == "dummy":
            init_dummy_weights(self.model, seed)
        else:
            load_weights(self.model, spec.model_dir)
        self.model.eval()
        self.layers = self.model.attention_layers()
        self.groups = groups_of(self.layers)  # one full-attention group (draft_check.py refuses windows)
        if device.type == "cuda":
            check_kernel_shapes(self.layers[0].head_dim, self.model.rotary_dim)
        self.vocab_size = spec.hf_config.vocab_size
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.max_batch = spec.max_batch
        self.kv_cache: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None  # capture_graphs: the single-token forwards
        self._tables = BlockTableRows()  # the scheduled sequences' tables, as the target's runner keeps its own
        # seq_id -> (its num_preemptions then, leading positions whose draft KV was written)
        self._written: dict[int, tuple[int, int]] = {}

    def block_bytes(self, block_size: int) -> int:
        """The draft's KV bytes of one block id (the pool is sized by the target's plus these)."""
        return block_bytes(self.groups, self.layers[0], block_size, self.dtype)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.kv_cache = allocate_kv_cache(self.layers, self.groups, num_blocks, block_size, self.dtype, self.device)
        logger.info(
            "draft model: weights %.3f GiB, KV %.3f GiB (%d blocks x %d tokens, indexed by the target's block tables)",
            self.weights_bytes / GiB,
            self.kv_cache.numel() * self.kv_cache.element_size() / GiB,
            num_blocks,
            block_size,
        )

    def capture_graphs(
        self, block_size: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
    ) -> None:
        """The draft's decode forward as CUDA graphs, for batches up to the most a step proposes for
        (after allocate: the graphs write the draft's KV)."""
        assert self.kv_cache is not None, "the draft's graphs are captured over its allocated KV"
        view = DraftGraphView(
            self.device,
            self.dtype,
            block_size,
            draft_batch_limit(max_num_seqs, self.max_batch),
            max_num_batched_tokens,
            max_model_len,
            self.model,
            self.groups,
        )
        self.graphs = DecodeGraphs(view)

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, host: DraftHost) -> list[int]:
        """engine/spec_draft.py's Drafter.propose_drafts (this module's docstring says how)."""
        assert self.kv_cache is not None, "the draft's KV is allocated with the target's"
        sched = out.scheduled
        if out.blocks_to_copy:  # the step's copy-on-write copies: a sharer's draft KV goes with its block
            pairs = host._to_device(np.array(out.blocks_to_copy, dtype=np.int64).T.copy())
            host._copy_blocks(self.kv_cache, pairs[0], pairs[1])
        verifying_seqs = [s for s in sched if s.spec_token_ids]
        if not verifying_seqs:
            return []  # nothing to propose: the draft does no work (it catches up when it next proposes)
        tables = self._tables.tables(verifying_seqs, len(verifying_seqs[0].seq.block_tables))[0]
        kv = np.fromiter((len(s.spec_token_ids) for s in verifying_seqs), dtype=np.int64, count=len(verifying_seqs))
        # the last token's position P (its KV is written by this step) and where the draft's KV stops
        last = np.fromiter((s.seq.num_computed_tokens for s in verifying_seqs), dtype=np.int64, count=len(kv))
        start = np.fromiter((self._valid(s.seq) for s in verifying_seqs), dtype=np.int64, count=len(kv))
        # the catch-up, every token from where the draft's KV stops to the last, in forwards of at
        # most max_num_batched_tokens tokens (as the target's chunks): the last one holds every
        # sequence's last token, whose row gives d_1
        budget = host.max_num_batched_tokens
        while int((last + 1 - start).sum()) > budget:
            take = np.minimum(last - start, np.maximum(budget - np.cumsum(last - start) + (last - start), 0))
            if not take.any():
                break
            self._forward(verifying_seqs, tables, start, take, host)
            start = start + take
        if (start == last).all():  # one token each (the usual case after verifying): a decode forward
            ids = np.fromiter((s.seq.token_ids[-1] for s in verifying_seqs), dtype=np.int64, count=len(kv))
            cur = self._decode(np.arange(len(kv)), last, tables, ids, None, host)
        else:
            hidden, cu = self._forward(verifying_seqs, tables, start, last + 1 - start, host)
            cur = self._greedy(hidden[host._to_device(cu[1:] - 1)])
        for s, p, k in zip(verifying_seqs, last.tolist(), kv.tolist(), strict=True):
            self._note(s.seq, p + k + 1)  # the forwards below write d_1 .. d_k' at P + 1 .. P + k'
        drafts = torch.empty((len(kv), int(kv.max())), dtype=torch.int64, device=self.device)
        drafts[:, 0] = cur
        for j in range(1, int(kv.max()) + 1):  # d_j at P + j (P = T - 1): its KV, and d_{j+1} while j < k'
            active = np.flatnonzero(kv >= j)
            ids_dev = cur if active.size == len(kv) else cur[host._to_device(active)]
            nxt = self._decode(active, last[active] + j, tables, None, ids_dev, host)
            more = np.flatnonzero(kv[active] > j)  # rows of `active` that need d_{j+1}
            if more.size:
                if more.size == len(kv):
                    cur = nxt
                else:
                    cur = cur.clone()
                    cur[host._to_device(active[more])] = nxt[host._to_device(more)]
                drafts[:, j] = cur
        host_drafts = drafts.tolist()  # the one wait of a verifying step's draft phase
        return [t for row, n in zip(host_drafts, kv.tolist(), strict=True) for t in row[:n]]

    def _decode(
        self,
        rows: np.ndarray,
        pos: np.ndarray,
        tables: np.ndarray,
        ids: np.ndarray | None,
        ids_dev: torch.Tensor | None,
        host: DraftHost,
    ) -> torch.Tensor:
        """One token for each sequence of `rows` at positions `pos` (ids on the host, or on the
        device): its KV written at its slot, and the greedy next token of each, on the device. A
        replay of the draft's decode graphs where they hold the batch, else eager."""
        bs = host.block_size
        slot = tables[rows, pos // bs].astype(np.int64) * bs + pos % bs
        step = DraftRows(
            input_ids=ids if ids is not None else np.zeros(len(rows), dtype=np.int64),
            positions=pos,
            slot_mapping=slot,
            seq_lens=(pos + 1).astype(np.int32),
            block_tables=tables[rows],
        )
        if self.graphs is not None and self.graphs.can_run(step):
            return replay(self.graphs, step, ids_dev, self.vocab_size)
        meta, dev = host._metadata_from(
            slot_mapping=slot,
            block_tables=step.block_tables,
            cu=np.arange(len(rows) + 1, dtype=np.int32),
            seq_lens=step.seq_lens,
            max_q=1,
            max_k=int(pos.max()) + 1,
            decode_only=True,
            no_history=False,
            extra=(pos,) if ids_dev is not None else (ids, pos),
        )
        input_ids = ids_dev if ids_dev is not None else dev[0]
        return self._greedy(self.model(input_ids, dev[-1], meta))

    def _forward(
        self, seqs: list, tables: np.ndarray, start: np.ndarray, n: np.ndarray, host: DraftHost
    ) -> tuple[torch.Tensor, np.ndarray]:
        """The draft over tokens [start, start + n) of each sequence (n may be 0 for some): their KV
        written; returns the hidden states and cu over the sequences with n > 0 (all of them in
        the final forward, where every n >= 1)."""
        rows = np.flatnonzero(n)
        start, n, tables = start[rows], n[rows], tables[rows]
        cu = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(n, out=cu[1:])
        total = int(cu[-1])
        seq_of_token = np.repeat(np.arange(len(rows)), n)
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), n)
        positions += np.repeat(start, n)
        input_ids = np.concatenate(
            [
                np.asarray(seqs[r].seq.token_ids[a : a + m], dtype=np.int64)
                for r, a, m in zip(rows, start, n, strict=True)
            ]
        )
        bs = host.block_size
        slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        end = start + n
        meta, (ids_dev, pos_dev) = host._metadata_from(
            slot_mapping=slots,
            block_tables=tables,
            cu=cu,
            seq_lens=end.astype(np.int32),
            max_q=int(n.max()),
            max_k=int(end.max()),
            decode_only=bool((n == 1).all()),
            no_history=bool((start == 0).all()),
            extra=(input_ids, positions),
        )
        return self.model(ids_dev, pos_dev, meta), cu

    def _valid(self, seq) -> int:
        """How many leading positions of `seq` hold the draft's KV: what its forwards wrote, cut back
        to the target's computed tokens (a rollback gave rejected proposals' slots back), or none if
        it was preempted since (its blocks were freed or swapped) or is new (a fork, a prefix-cache
        or host-tier hit: the draft never ran over those blocks' tokens as this sequence)."""
        entry = self._written.get(seq.seq_id)
        if entry is None or entry[0] != seq.num_preemptions:
            return 0
        return min(entry[1], seq.num_computed_tokens)

    def _note(self, seq, written: int) -> None:
        self._written.pop(seq.seq_id, None)
        self._written[seq.seq_id] = (seq.num_preemptions, written)  # newest last
        if len(self._written) > self.MAX_TRACKED:  # finished sequences: drop the oldest half
            for key in list(self._written)[: len(self._written) // 2]:
                del self._written[key]

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(hidden)
        return logits[:, : self.vocab_size].argmax(dim=-1)
