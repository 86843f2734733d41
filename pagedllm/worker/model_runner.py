"""ModelRunner: owns the device, the weights and the one KV tensor; turns a step's inputs
into sampled token ids. It never decides policy: the scheduler does. It is an Executor
(engine/executor.py) on its own, and rank r's model under TPExecutor."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm import envs
from pagedllm.engine.scheduler_output import PLACEHOLDER, SchedulerOutput
from pagedllm.engine.startup_times import StartupTimes
from pagedllm.engine.step_result import StepResult
from pagedllm.engine.structured_output import grammar_bitmask
from pagedllm.model.loader import init_dummy_weights, load_weights
from pagedllm.model.parallel import agree_min, tp_rank, tp_size
from pagedllm.model.quantization import prepare_quantization, quantize_linears
from pagedllm.model.registry import build_model
from pagedllm.ops import PAD_SLOT_ID
from pagedllm.ops.attention_metadata import AttentionMetadata, longest_first
from pagedllm.ops.copy_blocks import copy_blocks, copy_blocks_ref
from pagedllm.ops.kernels import kernels_for
from pagedllm.ops.kv_quant import is_fp8
from pagedllm.worker.device import check_kernel_shapes, kv_cache_dtype_name, resolve_kv_cache_dtype
from pagedllm.worker.device import resolve_device as resolve_device  # re-exported: entrypoints/llm.py
from pagedllm.worker.device import resolve_dtype as resolve_dtype
from pagedllm.worker.draft_model import DraftModel, DraftSpec
from pagedllm.worker.graph_capture import capture_graphs, explain_capture_oom, no_collection_while_capturing
from pagedllm.worker.host_kv_cache import HostKVCache, allocate_host_kv_cache, host_kv_blocks
from pagedllm.worker.kv_cache import block_bytes, groups_of
from pagedllm.worker.kv_scales import CALIBRATION_SEQ_LEN, CALIBRATION_TOKENS, choose_kv_scales
from pagedllm.worker.kv_sizing import allocate_and_log_kv_cache, size_kv_cache
from pagedllm.worker.logits_controls import TokenHistory
from pagedllm.worker.logprobs import PendingSampleLogprobs, prompt_logprobs
from pagedllm.worker.sampler import sample, sampling_tensors
from pagedllm.worker.staging import Staging, pad_to
from pagedllm.worker.step_handle import LaunchedStep, LoadTime, StepHandle
from pagedllm.worker.step_inputs import BlockTableRows, StepInputs, build_step_inputs
from pagedllm.worker.warm_up import forward_without_kv, warm_up_kernels

# async scheduling's device-side input ids (ModelRunner.placeholder_fix): (rows, sources) on the device, a
# count n (rows 0..n-1 take the previous step's sampled ids 0..n-1), or None (no placeholder)
PlaceholderFix = tuple[torch.Tensor, torch.Tensor] | int | None

if TYPE_CHECKING:
    from pagedllm.worker.cuda_graphs import DecodeGraphs
    from pagedllm.worker.mixed_graphs import MixedGraphs
    from pagedllm.worker.piecewise_graphs import PiecewiseGraphs


def _is_arange(a: np.ndarray, n: int) -> bool:
    """a == [0, 1, ..., n - 1]: every row of a decode step samples once."""
    return len(a) == n and bool((a == np.arange(n)).all())


class ModelRunner:
    supports_async = True  # execute_async: launch now, read the ids later (CPU: already there)

    def __init__(
        self,
        hf_config,
        model_dir: str,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        seed: int = 0,
        eos_token_ids: Iterable[int] = (),
        kv_cache_dtype: str = "auto",
        load_format: str = "auto",
        quantization: str | None = None,
        kv_offloading_size: float = 0.0,
        draft: DraftSpec | None = None,
    ):
        """quantization "fp8": the decoder layers' linear weights quantized to e4m3 after loading
        (per-channel scales; activations per token at run time: ops/fp8_linear.py).
        eos_token_ids: the ids that end a sequence, the scheduler's own set (masked while a
        request has fewer than min_tokens outputs). kv_cache_dtype: "auto" (the model's dtype),
        "fp8"/"fp8_e4m3" or "fp8_e5m2" (ops/kv_quant.py). load_format "dummy": seeded random
        weights instead of the checkpoint's (model/loader.py: init_dummy_weights). draft: a draft
        model for speculative decoding (worker/draft_model.py), its KV sized with the target's."""
        self.hf_config = hf_config
        self.device, self.dtype = device, dtype
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        self.startup = StartupTimes(sync)  # where start-up's seconds go (LLM logs them)
        self.kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, device)
        self.seed = seed
        self._ordered = envs.decode_launch_order() == "longest"  # decode attention: longest first
        with self.startup.phase("device init"):  # the first CUDA call creates the context
            self._staging = Staging(device) if device.type == "cuda" else None  # a step's arrays in one copy
            # the sampler's per-row arrays and the placeholder rows, each in one copy (`_upload`)
            self._small_staging = Staging(device, 1 << 20) if device.type == "cuda" else None
        self.block_size = block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.vocab_size = hf_config.vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enforce_eager = enforce_eager or device.type != "cuda"
        torch.manual_seed(seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device), self.startup.phase("model build"):
                self.model = build_model(hf_config, kernels_for(device), max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        checkpoint_quant, quantization = prepare_quantization(self.model, hf_config, quantization, device)
        with self.startup.phase("weights"):
            if load_format == "dummy":
                checkpoint_kv_scales: dict[int, dict[str, float]] = init_dummy_weights(self.model, seed)
            else:
                checkpoint_kv_scales = load_weights(self.model, model_dir, checkpoint_quant)
        self.model.eval()
        if quantization is not None:
            with self.startup.phase("fp8 weights"):
                quantize_linears(self.model, quantization, device)
        self.attn_layers = self.model.attention_layers()
        self.kv_cache_groups = groups_of(self.attn_layers)  # the Executor protocol: the scheduler's groups
        a = self.attn_layers[0]
        self.num_kv_heads, self.head_dim = a.num_kv_heads, a.head_dim
        if device.type == "cuda":
            check_kernel_shapes(a.head_dim, self.model.rotary_dim)
        self.kv_scales: list[tuple[float, float]] = [(1.0, 1.0)] * len(self.attn_layers)
        self.kv_scales_source = "none (the cache is in the model's dtype)"
        if is_fp8(self.kv_dtype):  # before sizing and graphs: the scales are fixed from here on
            with self.startup.phase("fp8 scales"):
                self.kv_scales, self.kv_scales_source = choose_kv_scales(
                    self.attn_layers, checkpoint_kv_scales, self.kv_dtype, self._calibration_forward
                )
            for layer, (k_scale, v_scale) in zip(self.attn_layers, self.kv_scales, strict=True):
                layer.set_kv_scales(k_scale, v_scale)
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.draft: DraftModel | None = None
        if draft is not None:
            with self.startup.phase("draft model"):
                self.draft = DraftModel(draft, device, dtype, max_model_len, load_format, seed)
        with self.startup.phase("profile run"):  # kv_sizing.py; peak: measured by the profile run (CUDA), else 0
            blocks, self.peak_activation_bytes, kv_sizing = size_kv_cache(
                self, num_kv_blocks, kv_cache_memory_bytes, gpu_memory_utilization
            )
        self.is_driver = tp_rank() == 0  # with TP, rank 0 alone samples
        self.num_kv_blocks: int = agree_min(blocks)  # TP: the same block ids on every rank
        with self.startup.phase("KV allocation"):
            self.kv_cache = allocate_and_log_kv_cache(self)
            if self.draft is not None:
                self.draft.allocate(self.num_kv_blocks, block_size)
        self.num_host_kv_blocks: int = agree_min(host_kv_blocks(kv_offloading_size, self.block_bytes, tp_size()))
        self.host_kv: HostKVCache | None = None
        if self.num_host_kv_blocks:
            with self.startup.phase("host KV tier"):
                self.host_kv = allocate_host_kv_cache(self.kv_cache, self.num_host_kv_blocks)
        self._copy_blocks = copy_blocks_ref if device.type != "cuda" else copy_blocks
        # CUDA: Philox noise keyed per row (fused Gumbel-max kernel); PAGEDLLM_SAMPLER=torch
        # falls back to torch's generators
        self.philox_sampling = device.type == "cuda" and envs.sampler() != "torch"
        self.triton_compiles = None  # PAGEDLLM_LOG_TRITON_COMPILES: the compile log (worker/triton_compiles.py)
        if device.type == "cuda" and envs.log_triton_compiles():
            from pagedllm.worker.triton_compiles import install

            self.triton_compiles = install()
        if device.type == "cuda":
            with self.startup.phase("kernel warm-up"):
                warm_up_kernels(self)
        self._seed_rng = np.random.default_rng(seed)
        self._block_table_rows = BlockTableRows()  # the scheduled sequences' tables as arrays, across steps
        self._token_history = TokenHistory()  # penalized sequences' token ids as arrays, across steps
        self._last_sampled: torch.Tensor | None = None  # async scheduling: the previous step's ids
        self._last_sample_seq_ids: list[int] = []  # ... and whose they are, row by row
        # a step's sampled ids, copied out (step_handle.py): one row per sequence, or with speculative
        # decoding one per verified position (1 + k of a sequence), so at most one per scheduled token
        rows = max(max_num_seqs, max_num_batched_tokens)
        self._host_ids = [torch.zeros(rows, dtype=torch.int64, pin_memory=device.type == "cuda") for _ in range(2)]
        self.graphs: DecodeGraphs | None = None  # CUDA graphs: decode, whole small steps, piecewise (graph_capture.py)
        self.mixed: MixedGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        if not self.enforce_eager:
            kv_bytes = self.num_kv_blocks * self.pool_block_bytes
            with explain_capture_oom(gpu_memory_utilization, kv_bytes, kv_sizing):
                self.graphs, self.mixed, self.piecewise = capture_graphs(self, self.startup)
                if self.draft is not None:
                    with self.startup.phase("draft graphs"), no_collection_while_capturing():
                        self.draft.capture_graphs(block_size, max_num_seqs, max_num_batched_tokens, max_model_len)

    # ---- KV cache ----------------------------------------------------------------------
    @property
    def kv_cache_dtype(self) -> str:
        """The KV format's resolved name, for logs and metrics (the Executor protocol)."""
        return kv_cache_dtype_name(self.kv_dtype)

    @property
    def block_bytes(self) -> int:
        return block_bytes(self.kv_cache_groups, self.attn_layers[0], self.block_size, self.kv_dtype)

    @property
    def pool_block_bytes(self) -> int:
        """What one block id costs: the target's KV and, with a draft model, the draft's (the pool's sizing unit)."""
        return self.block_bytes + (0 if self.draft is None else self.draft.block_bytes(self.block_size))

    def _calibration_forward(self) -> None:
        """The forward whose K/V ranges size the fp8 scales (worker/kv_scales.py): seeded, and the
        same batch whatever the scheduler's limits (a start-up pass, not a step), so engines that
        differ only in those limits store the same bytes."""
        seq_len = min(CALIBRATION_SEQ_LEN, self.max_model_len)
        num_seqs = -(-CALIBRATION_TOKENS // seq_len)
        forward_without_kv(self, num_seqs * seq_len, num_seqs, np.random.default_rng(self.seed))

    # ---- one step ----------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.run(self.step_inputs(out))

    def step_inputs(self, out: SchedulerOutput) -> StepInputs:
        return build_step_inputs(
            out,
            self.block_size,
            self.vocab_size,
            self.eos_token_ids,
            self.kv_cache_groups,
            self._block_table_rows,
            self._token_history,
        )

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Small arrays on the device, on CUDA in one copy from a pinned buffer used in turn
        (worker/staging.py) instead of a pinned allocation and a copy each; each call's tensors
        are read by kernels queued before the next call's copy."""
        if self._small_staging is not None and self._small_staging.fits(arrays):
            return self._small_staging.upload(arrays)
        return [self._to_device(a) for a in arrays]

    def _metadata_from(
        self, *, slot_mapping, block_tables, cu, seq_lens, max_q, max_k, decode_only, no_history, groups=(), extra=()
    ) -> tuple[AttentionMetadata, list[torch.Tensor]]:
        """groups: (slot_mapping, block_tables) of the KV-cache groups after the first; extra:
        more arrays to upload with them (ids, positions), returned on the device. On CUDA all of
        them go up in one copy (worker/staging.py)."""
        order = [longest_first(seq_lens)] if decode_only and self._ordered else []  # decode attention's launch order
        arrays = [slot_mapping, block_tables, cu, seq_lens, *order, *(a for pair in groups for a in pair), *extra]
        if self._staging is not None and self._staging.fits(arrays):
            dev = self._staging.upload(arrays)
        else:
            dev = [self._to_device(a) for a in arrays]
        seq_order = dev.pop(4) if order else None
        n = 4 + 2 * len(groups)
        meta = AttentionMetadata(
            slot_mapping=dev[0],
            block_tables=dev[1],
            cu_seqlens_q=dev[2],
            seq_lens=dev[3],
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            decode_only=decode_only,
            no_history=no_history,
            seq_order=seq_order,
        ).add_groups((dev[i], dev[i + 1]) for i in range(4, n, 2))
        return meta, dev[n:]

    @torch.inference_mode()
    def run(self, inp: StepInputs) -> StepResult:
        return StepHandle(self.launch(inp), self._host_ids).result()

    def execute_async(self, out: SchedulerOutput) -> StepHandle:
        """Launch a step and return at once; `.result()` waits for its sampled ids (and logprobs).
        The next step may be launched before that: its PLACEHOLDER inputs are read from this
        step's sampled tensor on the device."""
        with torch.inference_mode():
            launched = self.launch(self.step_inputs(out))
        return StepHandle(launched, self._host_ids)

    def close(self) -> None:
        """The host tier's pinned buffer goes back now; the weights, the KV tensor and the CUDA
        graphs go with this object."""
        if self.host_kv is not None:
            self.host_kv.close()
            self.host_kv = None

    def launch(self, inp: StepInputs) -> LaunchedStep:
        """Queue one step's work on the device; its results stay there until a StepHandle copies
        them. Every tensor-parallel rank runs the same calls (compute_logits is a collective)."""
        load_time = self._kv_transfers(inp)  # host tier: offloads, then loads (host_kv_cache.py)
        if inp.blocks_to_copy:  # copy-on-write, queued before the forward (and any graph replay)
            pairs = self._to_device(np.array(inp.blocks_to_copy, dtype=np.int64).T.copy())
            self._copy_blocks(self.kv_cache, pairs[0], pairs[1])
        fix = self.placeholder_fix(inp.input_ids, inp.cu_seqlens_q, inp.seq_ids)
        logits: torch.Tensor | None = None
        prompt = None
        if self.graphs is not None and inp.decode_only and not inp.prompt_logprobs and self.graphs.can_run(inp):
            logits = self.graphs.run(inp, fix)
            if not _is_arange(inp.logits_indices, inp.num_seqs):  # rows that do not sample, or forks
                logits = logits[self._to_device(inp.logits_indices)]
        else:
            hidden = self.forward(inp, fix)
            if len(inp.logits_indices):
                logits = self.model.compute_logits(hidden[self._to_device(inp.logits_indices)])
            if inp.prompt_logprobs:
                prompt = prompt_logprobs(
                    self.model.compute_logits, hidden, inp.prompt_logprobs, self._to_device, self.is_driver
                )
        if logits is None or not self.is_driver:  # nothing to sample, or not rank 0 of a TP group
            return LaunchedStep(None, None, prompt, load_time)
        if inp.grammar_seqs is not None:  # the forward is queued: the host fills the grammar mask meanwhile
            inp.token_bitmask = grammar_bitmask(inp.grammar_seqs, self.vocab_size)
        pending = None  # the raw logits of the rows that ask, before the sampler masks in place
        if inp.num_logprobs is not None:
            pending = PendingSampleLogprobs(logits, inp.num_logprobs, self._to_device)
        sampled = self.sample(logits, inp)
        self._last_sampled, self._last_sample_seq_ids = sampled, inp.sample_seq_ids
        return LaunchedStep(sampled, None if pending is None else pending.finish(sampled), prompt, load_time)

    def _kv_transfers(self, inp: StepInputs) -> LoadTime:
        """The step's host-tier copies, before its copy-on-write copies and forward: offloads, the
        loads this step reads, then the prefetch loads the next step reads (host_kv_cache.py). The
        loads' time: seconds on CPU, a pair of CUDA events to read once the step is done."""
        if self.host_kv is None:
            assert not (inp.blocks_to_offload or inp.blocks_to_load or inp.blocks_to_prefetch), (
                "host-tier copies sent to a runner without kv_offloading_size"
            )
            return 0.0
        self.host_kv.begin_step()
        self.host_kv.offload(inp.blocks_to_offload)
        return self.host_kv.load(inp.blocks_to_load, inp.blocks_to_prefetch)

    def propose_drafts(self, out: SchedulerOutput) -> list[int]:
        """engine/spec_draft.py's Drafter: the draft model's forwards, before the step's own."""
        assert self.draft is not None, "speculative_config.model: this runner was built without a draft"
        return self.draft.propose(out, self)

    def placeholder_fix(self, input_ids: np.ndarray, cu_seqlens_q: np.ndarray, seq_ids: list[int]) -> PlaceholderFix:
        """Async scheduling: input rows whose token id is still a PLACEHOLDER, and where the
        previous step's sampled tensor holds it: (rows, sources) on the device, or None. A decode
        step whose rows are all placeholders, in the previous step's sample order (the steady
        state), is just their count n: rows 0..n-1 take sampled ids 0..n-1, one device copy and no upload."""
        rows = np.flatnonzero(input_ids == PLACEHOLDER)
        if rows.size == 0:
            return None
        last = self._last_sample_seq_ids
        if rows.size == len(input_ids) == len(seq_ids) and seq_ids == last[: rows.size] and len(set(last)) == len(last):
            return rows.size
        seq_index = np.searchsorted(cu_seqlens_q, rows, side="right") - 1
        last_row = {seq_id: i for i, seq_id in enumerate(last)}
        src = np.fromiter((last_row[seq_ids[j]] for j in seq_index), dtype=np.int64, count=rows.size)
        rows_t, src_t = self._upload([rows, src])
        return rows_t, src_t

    def fill_placeholders(self, input_ids: torch.Tensor, fix: PlaceholderFix) -> None:
        if fix is None:
            return
        assert self._last_sampled is not None, "a PLACEHOLDER input with no step launched before"
        if isinstance(fix, int):
            input_ids[:fix].copy_(self._last_sampled[:fix])
        else:
            rows, src = fix
            input_ids[rows] = self._last_sampled[src]

    def forward(self, inp: StepInputs, fix=None) -> torch.Tensor:
        """The step's hidden states [T, hidden]: one CUDA-graph replay where a small step fits
        (worker/mixed_graphs.py), else piecewise CUDA graphs where a bucket holds the step's
        tokens (worker/piecewise_graphs.py), else eager."""
        if self.mixed is not None and self.mixed.can_run(inp):
            return self.mixed.run(inp, fix)
        pw = self.piecewise if self.piecewise is not None and self.piecewise.can_run(inp) else None
        t = pw.bucket(inp.num_tokens) if pw is not None else inp.num_tokens
        pad = (lambda a: pad_to(a, t, PAD_SLOT_ID)) if pw is not None else (lambda a: a)
        meta, dev = self._metadata_from(
            slot_mapping=pad(inp.slot_mapping),
            block_tables=inp.block_tables,
            cu=inp.cu_seqlens_q,
            seq_lens=inp.seq_lens,
            max_q=inp.max_seqlen_q,
            max_k=inp.max_seqlen_k,
            decode_only=inp.decode_only,
            no_history=inp.no_history,
            groups=[(pad(sm), bt) for sm, bt in inp.group_tables],
            extra=() if pw is not None else (inp.input_ids, inp.positions),
        )
        if pw is not None:
            return pw.run(inp, meta, fix)
        input_ids, positions = dev
        self.fill_placeholders(input_ids, fix)
        return self.model(input_ids, positions, meta)

    def sample(self, logits: torch.Tensor, inp: StepInputs) -> torch.Tensor:
        rng = self._seed_rng if self.philox_sampling else None
        return sample(logits, sampling_tensors(inp, self.vocab_size, self.device, self._to_device, rng, self._upload))
