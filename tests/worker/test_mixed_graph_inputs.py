"""What a whole-step CUDA graph computes (worker/mixed_graphs.py), checked on CPU: the step
padded to its (token, sequence) bucket by `padded_step` and run through the Triton kernels (the
interpreter) gives the unpadded step's hidden states on its real rows and writes exactly the
same KV cache: padding tokens are stored nowhere, padding sequences are attended by nobody.
The graph capture itself needs CUDA (tests/gpu); this is the arithmetic it replays."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen3Config

pytest.importorskip("triton")

from pagedllm.model.attention_metadata import AttentionMetadata  # noqa: E402
from pagedllm.model.registry import build_model  # noqa: E402
from pagedllm.ops.kernels import TritonKernels  # noqa: E402
from pagedllm.worker.mixed_graphs import padded_step  # noqa: E402

BS, LAYERS, BLOCKS = 4, 2, 24


def model_and_cache():
    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        architectures=["Qwen3ForCausalLM"],
    )
    torch.set_default_dtype(torch.float32)
    model = build_model(cfg, TritonKernels())
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    kv = torch.randn(2, LAYERS, BLOCKS, 2, BS, 16, generator=g)  # history: whatever the blocks hold
    for layer, k, v in zip(model.attention_layers(), kv[0], kv[1], strict=True):
        layer.bind_kv_cache(k, v)
    return model, kv


def step():
    """Two decodes over histories, a chunk over a cached prefix, a fresh prompt: 1 + 1 + 5 + 6 tokens."""
    q_lens, hist = [1, 1, 5, 6], [9, 3, 8, 0]
    seq_lens = np.array([q + h for q, h in zip(q_lens, hist, strict=True)], np.int32)
    tables = np.arange(4 * 6, dtype=np.int32).reshape(4, 6)  # sequence i owns blocks 6i..6i+5
    positions = np.concatenate([np.arange(h, h + q) for q, h in zip(q_lens, hist, strict=True)]).astype(np.int64)
    rows = np.repeat(np.arange(4), q_lens)
    slots = (tables[rows, positions // BS] * BS + positions % BS).astype(np.int64)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    ids = (np.arange(len(positions)) * 5 + 3) % 64
    return ids.astype(np.int64), positions, cu, seq_lens, slots, tables


def meta_of(a: dict, max_q: int) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(a["slot_mapping0"]),
        block_tables=torch.from_numpy(a["block_tables0"]),
        cu_seqlens_q=torch.from_numpy(a["cu_seqlens_q"]),
        seq_lens=torch.from_numpy(a["seq_lens"]),
        max_seqlen_q=max_q,
        max_seqlen_k=int(a["seq_lens"].max()),
        decode_only=False,
        no_history=False,
    )


@torch.inference_mode()
def test_a_padded_step_computes_the_step():
    ids, positions, cu, seq_lens, slots, tables = step()
    n = len(ids)
    model, kv = model_and_cache()
    exact = padded_step(ids, positions, cu, seq_lens, [(slots, tables)], n, len(seq_lens))  # no padding
    want = model(torch.from_numpy(exact["input_ids"]), torch.from_numpy(exact["positions"]), meta_of(exact, 6))
    kv_want = kv.clone()

    model, kv = model_and_cache()
    t, b = 32, 16  # the buckets: 19 padding tokens, 12 padding sequences
    a = padded_step(ids, positions, cu, seq_lens, [(slots, tables)], t, b)
    nseq = len(seq_lens)
    assert a["cu_seqlens_q"].tolist()[nseq:] == [n] * (b - nseq + 1) and a["seq_lens"][nseq:].tolist() == [0] * 12
    # the grid sized by the bucket, as the graph was captured (max_seqlen_q = t)
    got = model(torch.from_numpy(a["input_ids"]), torch.from_numpy(a["positions"]), meta_of(a, t))
    assert got.shape[0] == t
    torch.testing.assert_close(got[:n], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(kv, kv_want)  # the same blocks written, and nothing else
