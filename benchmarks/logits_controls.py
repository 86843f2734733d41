#!/usr/bin/env python3
"""Cost of the token controls in one sampling step, without a model.

256 sequences (512 random prompt tokens, 64 output tokens to start) sample at temperature 1 from
random logits [256, V] for V = 8192 (the bundled model) and 151936 (Qwen3); each timed step appends
one token to every sequence, as a decode step does. Three batches:
  none        - no row uses a control: the step's LogitsControls is None (today's path);
  all_rep     - every row has repetition_penalty=1.1 (prompt and output ids counted on the device);
  tenth_mixed - every tenth row has repetition_penalty, frequency_penalty and presence_penalty.
Per step: `host_ms` builds the controls (worker/logits_controls.py, TokenHistory kept across steps),
`device_ms` copies them, applies them and samples (worker/sampler.py), synchronised at the end.
Median of --steps steps after --warmup. Prints one JSON object.

    python benchmarks/logits_controls.py --device cpu --no-save
    python benchmarks/logits_controls.py --device cuda --results-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from pagedllm.bench.common import environment, save_results
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.sequence import Sequence
from pagedllm.worker.logits_controls import TokenHistory, build_logits_controls
from pagedllm.worker.sampler import sample, sampling_tensors
from pagedllm.worker.step_inputs import StepInputs

BATCH, PROMPT, OUTPUT = 256, 512, 64
PLAIN = SamplingParams(temperature=1.0, max_tokens=10_000)
REP = SamplingParams(temperature=1.0, max_tokens=10_000, repetition_penalty=1.1)
MIXED = SamplingParams(
    temperature=1.0, max_tokens=10_000, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5
)
BATCHES = {
    "none": lambda i: PLAIN,
    "all_rep": lambda i: REP,
    "tenth_mixed": lambda i: MIXED if i % 10 == 0 else PLAIN,
}


def step_inputs(seqs: list[Sequence], vocab: int, history: TokenHistory) -> StepInputs:
    """A decode step's sampling fields (the forward's are never read here)."""
    b = len(seqs)
    zeros = np.zeros(b, dtype=np.int64)
    return StepInputs(
        input_ids=zeros,
        positions=np.array([s.num_tokens - 1 for s in seqs], dtype=np.int64),
        slot_mapping=zeros,
        block_tables=np.zeros((b, 1), dtype=np.int32),
        cu_seqlens_q=np.arange(b + 1, dtype=np.int32),
        seq_lens=np.ones(b, dtype=np.int32),
        logits_indices=np.arange(b, dtype=np.int64),
        max_seqlen_q=1,
        max_seqlen_k=1,
        decode_only=True,
        no_history=False,
        blocks_to_copy=[],
        seq_ids=[s.seq_id for s in seqs],
        sample_seq_ids=[s.seq_id for s in seqs],
        temperature=np.ones(b, dtype=np.float32),
        top_k=np.full(b, vocab, dtype=np.int64),
        top_p=np.ones(b, dtype=np.float32),
        min_p=np.zeros(b, dtype=np.float32),
        seeds=[None] * b,
        logits_controls=build_logits_controls(seqs, vocab, history)
        if any(s.sampling_params.uses_penalties for s in seqs)
        else None,
    )


def measure(vocab: int, batch: str, device: torch.device, steps: int, warmup: int) -> dict:
    rng = np.random.default_rng(0)
    seqs = []
    for i in range(BATCH):
        s = Sequence(str(i), rng.integers(0, vocab, PROMPT).tolist(), BATCHES[batch](i))
        s.token_ids += rng.integers(0, vocab, OUTPUT).tolist()
        seqs.append(s)
    cuda = device.type == "cuda"

    def to_device(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t.pin_memory().to(device, non_blocking=True) if cuda else t

    philox = np.random.default_rng(1) if cuda else None
    logits = torch.randn(BATCH, vocab, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    history = TokenHistory()
    host, dev = [], []
    for k in range(warmup + steps):
        t0 = time.perf_counter()
        inp = step_inputs(seqs, vocab, history)
        t1 = time.perf_counter()
        ids = sample(logits.clone(), sampling_tensors(inp, vocab, device, to_device, philox))
        if cuda:
            torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        for s, t in zip(seqs, ids.tolist(), strict=True):
            s.token_ids.append(t)
        if k >= warmup:
            host.append((t1 - t0) * 1e3)
            dev.append((t2 - t1) * 1e3)
    return {
        "vocab": vocab,
        "batch": batch,
        "host_ms": round(statistics.median(host), 3),
        "device_ms": round(statistics.median(dev), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab", type=int, nargs="+", default=[8192, 151936])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--results-dir", default="benchmarks/results")
    p.add_argument("--out", default=None)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args()
    device = torch.device(args.device)
    rows = []
    with torch.inference_mode():
        for v in args.vocab:
            for name in BATCHES:
                rows.append(measure(v, name, device, args.steps, args.warmup))
                print(rows[-1], file=sys.stderr)
    result = {
        **environment(),
        "benchmark": "logits_controls",
        "device": str(device),
        "batch_size": BATCH,
        "prompt_tokens": PROMPT,
        "rows": rows,
    }
    print(json.dumps(result, indent=1))
    save_results(result, args, f"logits-controls-{device.type}")


if __name__ == "__main__":
    main()
