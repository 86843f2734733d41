"""The start-up forward passes: the KV-sizing profile run, the forward with no KV bound (profile and
fp8 calibration), and the compiles of the kernels the first real requests would otherwise wait for."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.ops import PAD_SLOT_ID
from pagedllm.worker.device import GiB

if TYPE_CHECKING:
    from pagedllm.worker.runner_view import WarmUpRunner


@torch.inference_mode()
def warm_up_kernels(runner: WarmUpRunner) -> None:
    """Compile the attention kernel's prefill-with-history variant (a step mixing one
    decode row with a chunk over a cached prefix) and the sampling kernel at start-up, so
    the first real requests do not wait for Triton; and the copy-on-write kernel. The profiling
    run covered the other kernels, the CUDA graphs cover decode. Changes nothing in the KV cache."""
    hist, chunk = runner.block_size, 8
    lens_q = np.array([1, chunk])
    seq_lens = (hist + lens_q).astype(np.int32)
    cu = np.array([0, 1, 1 + chunk], dtype=np.int32)
    positions = np.concatenate([np.arange(hist, n) for n in seq_lens]).astype(np.int64)
    nb = -(-int(seq_lens.max()) // runner.block_size)
    table = (np.arange(nb) % runner.num_kv_blocks).astype(np.int32)
    meta, _ = runner._metadata_from(
        slot_mapping=np.full(len(positions), PAD_SLOT_ID),
        cu=cu,
        seq_lens=seq_lens,
        block_tables=np.stack([table, table]),
        max_q=chunk,
        max_k=int(seq_lens.max()),
        decode_only=False,
        no_history=False,
    )
    ids = torch.zeros(len(positions), dtype=torch.int64, device=runner.device)
    hidden = runner.model(ids, runner._to_device(positions), meta)
    logits = runner.model.compute_logits(hidden[cu[1:] - 1])
    if runner.philox_sampling and runner.is_driver and logits is not None:  # the sampling kernel too
        from pagedllm.ops.sampling import gumbel_sample

        gumbel_sample(
            logits,
            torch.tensor([1.0, 0.0], device=runner.device),
            torch.tensor([1, 2], dtype=torch.int64, device=runner.device),
        )
    zero = torch.zeros(1, dtype=torch.int64, device=runner.device)
    runner._copy_blocks(runner.kv_cache, zero, zero)  # the copy-on-write kernel (block 0 onto itself: a no-op)
    torch.cuda.synchronize(runner.device)


@torch.inference_mode()
def profile_kv_blocks(runner: WarmUpRunner, utilization: float) -> tuple[int, int]:
    """KV sizing (docs/architecture.md): total * utilization - used - peak + current, after a warm-up forward
    at the largest batch the scheduler can form."""
    torch.cuda.synchronize(runner.device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(runner.device)
    n = min(runner.max_num_batched_tokens, runner.max_num_seqs * runner.max_model_len)
    num_seqs = min(runner.max_num_seqs, n)
    forward_without_kv(runner, n, num_seqs, np.random.default_rng(runner.seed), logits=True)
    torch.cuda.synchronize(runner.device)
    free, total = torch.cuda.mem_get_info(runner.device)
    used = total - free
    stats = torch.cuda.memory_stats(runner.device)
    peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
    budget = total * utilization - used - peak + current
    blocks = int(budget // runner.pool_block_bytes)  # a draft model's KV shares the budget
    if blocks < 1:
        raise ValueError(
            f"no GPU memory left for the KV cache (budget {budget / GiB:.2f} GiB); raise "
            "gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return blocks, peak - current


@torch.inference_mode()
def forward_without_kv(
    runner: WarmUpRunner, n: int, num_seqs: int, rng: np.random.Generator, logits: bool = False
) -> None:
    """One forward over n random tokens in num_seqs sequences with no KV bound (the new tokens
    attend to each other only): the profile run, and the fp8 scales' calibration."""
    per_seq = n // num_seqs
    lens = np.full(num_seqs, per_seq, dtype=np.int64)
    lens[: n - per_seq * num_seqs] += 1
    cu = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    positions = np.concatenate([np.arange(k) for k in lens])
    ids = rng.integers(0, runner.vocab_size, size=n)
    meta, _ = runner._metadata_from(
        slot_mapping=np.full(n, PAD_SLOT_ID),
        block_tables=np.zeros((num_seqs, 1), np.int32),  # unused: no KV is bound yet
        cu=cu,
        seq_lens=lens.astype(np.int32),
        max_q=int(lens.max()),
        max_k=int(lens.max()),
        decode_only=False,
        no_history=True,
    )
    hidden = runner.model(torch.from_numpy(ids).to(runner.device), torch.from_numpy(positions).to(runner.device), meta)
    if logits:
        runner.model.compute_logits(hidden[cu[1:] - 1])
