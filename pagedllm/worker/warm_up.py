"""Start-up compiles of the kernels the first real requests would otherwise wait for (CUDA)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.ops import PAD_SLOT_ID

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
