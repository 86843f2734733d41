"""What a whole-step CUDA graph computes (worker/mixed_graphs.py), checked on CPU: the step
padded to its (token, sequence) bucket by `padded_step` and run through the Triton kernels (the
interpreter) gives the unpadded step's hidden states on its real rows and writes exactly the
same KV cache: padding tokens are stored nowhere, padding sequences are attended by nobody.
The graph capture itself needs CUDA (tests/gpu); this is the arithmetic it replays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from pagedllm.ops.attention_metadata import AttentionMetadata  # noqa: E402
from pagedllm.ops.kernels import TritonKernels  # noqa: E402
from pagedllm.worker.mixed_graphs import padded_step, write_padded_step  # noqa: E402
from pagedllm.worker.staging import PackedInputs  # noqa: E402
from tests.ops.test_kernels import tiny_model  # noqa: E402

BS, BLOCKS = 4, 24


def model_and_cache():
    """The kernel tests' tiny Qwen3 on the Triton kernels, over a KV cache holding random history."""
    torch.set_default_dtype(torch.float32)
    model, kv = tiny_model(TritonKernels(), num_blocks=BLOCKS, block_size=BS)
    kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(1)))
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


@torch.inference_mode()
def test_a_step_written_over_a_larger_one_computes_the_step():
    """The graphs' buffers are reused: a step written over a larger step's values (stale tokens past
    its bucket, stale table rows and columns past its sequences) must still compute the step."""
    ids, positions, cu, seq_lens, slots, tables = step()
    n, t, b, top_t, top_b, width = len(ids), 32, 16, 64, 32, 10
    model, kv = model_and_cache()
    exact = padded_step(ids, positions, cu, seq_lens, [(slots, tables)], n, len(seq_lens))
    want = model(torch.from_numpy(exact["input_ids"]), torch.from_numpy(exact["positions"]), meta_of(exact, 6))
    kv_want = kv.clone()

    model, kv = model_and_cache()
    p = PackedInputs(
        [
            ("input_ids", torch.int64, (top_t,)),
            ("positions", torch.int64, (top_t,)),
            ("slot_mapping0", torch.int64, (top_t,)),
            ("cu_seqlens_q", torch.int32, (top_b + 1,)),
            ("seq_lens", torch.int32, (top_b,)),
            ("block_tables0", torch.int32, (top_b, width)),
        ],
        torch.device("cpu"),
    )
    for _ in range(2):  # both host sets hold a larger step's values
        h = p.next_host()
        for a in h.values():
            a[...] = 3
        p.upload(top_b)
    write_padded_step(p.next_host(), ids, positions, cu, seq_lens, [(slots, tables)], t, b)
    p.upload(b)
    d = p.dev
    meta = AttentionMetadata(
        slot_mapping=d["slot_mapping0"][:t],
        block_tables=d["block_tables0"][:b],
        cu_seqlens_q=d["cu_seqlens_q"][: b + 1],
        seq_lens=d["seq_lens"][:b],
        max_seqlen_q=t,
        max_seqlen_k=width * BS,
        decode_only=False,
        no_history=False,
    )
    got = model(d["input_ids"][:t], d["positions"][:t], meta)
    torch.testing.assert_close(got[:n], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(kv, kv_want)  # the same blocks written, and nothing else


def test_bucket_pair_is_the_tightest_captured_bucket():
    """A step replays the smallest captured (tokens, sequences) pair it fits: the 16 req/s serving
    step (a 512-token prompt beside 3 decodes) pads to 640 tokens, not 1,024, and no step of more
    than 128 tokens pads to 1.5 times its size or more."""
    from pagedllm.worker.mixed_graphs import SEQ_BUCKETS, TOKEN_BUCKETS, bucket_pair

    tokens, seqs = list(TOKEN_BUCKETS), list(SEQ_BUCKETS)
    assert bucket_pair(515, 4, tokens, seqs) == (640, 4)
    assert bucket_pair(512, 1, tokens, seqs) == (512, 4)
    assert bucket_pair(3, 3, tokens, seqs) == (16, 4)
    assert bucket_pair(10, 20, tokens, seqs) == (64, 64)  # a captured pair has sequences <= tokens
    assert bucket_pair(2049, 4, tokens, seqs) is None
    assert bucket_pair(100, 65, tokens, seqs) is None
    for n in range(129, tokens[-1] + 1):
        pair = bucket_pair(n, 4, tokens, seqs)
        assert pair is not None and n <= pair[0] < 1.5 * n, (n, pair)
    # a runner whose max_num_batched_tokens leaves out the larger buckets
    assert bucket_pair(700, 4, [t for t in tokens if t <= 512], seqs) is None
