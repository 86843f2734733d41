"""The serving benchmark's workload: vLLM's random dataset and Poisson arrivals.

Each prompt is `length` token ids drawn uniformly from the tokenizer's vocabulary less its
special tokens, so the server sees exactly `length` prompt tokens (no re-tokenization drift)
and no prompt ends early on an EOS. Both draws are seeded: the same seed gives the same prompts
and the same arrival times (and so hits the prefix cache of a server that saw them already).
"""

from __future__ import annotations

import math
import random

from pagedllm.entrypoints.model_dir import load_tokenizer


def random_prompts(tokenizer_dir: str, num: int, length: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` random non-special token ids of the tokenizer in `tokenizer_dir`."""
    tok = load_tokenizer(tokenizer_dir)
    if tok is None:
        raise ValueError(f"{tokenizer_dir} has no tokenizer files: the random dataset draws from its vocabulary")
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    rng = random.Random(seed)
    return [rng.choices(vocab, k=length) for _ in range(num)]


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Start time of each request (s from the start): Poisson process at `rate`, or all at 0."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed + 1)  # a stream of its own, apart from the prompts' draws
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate)
    return out
