#!/usr/bin/env python3
"""Regenerate the pictures of docs/features/block-trace.md: two real KV block traces of the bundled
model on CPU (greedy, so every run draws the same picture), drawn by `pagedllm trace view`.

  prefix-reuse  a burst of requests behind one system prompt (REUSE), one of them with n=2
                (fork, copy-on-write), then a later request that finds the prompt's blocks
                cached-free (REACTIVATE)
  preemption    long answers in a pool too small for all of them: preempted sequences give
                their blocks back and, resumed, re-hit their own prefix; cached blocks are EVICTed

    python tools/make_trace_pictures.py                   # SVGs into docs/features/img/
    python tools/make_trace_pictures.py --traces /tmp/t   # and keep the JSON-lines traces
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the tiny model gains nothing from more threads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SYSTEM = (
    "You are a careful Python assistant. Answer with short, correct code and no prose. Prefer the standard library. "
)
QUESTIONS = ["def fibonacci(n):", "import os\n", "class Stack:", "def is_prime(n):", "for i in range("]


def record(path: str, llm_kwargs: dict, batches: list) -> None:
    """Run the batches one after another on one LLM, its block trace (stderr) into `path`.
    The LLM's log lines land there too; the viewer skips them."""
    from pagedllm import LLM, default_model_path

    with open(path, "w", encoding="utf-8") as f, contextlib.redirect_stderr(f):
        llm = LLM(default_model_path(), device="cpu", block_size=16, trace_blocks=True, **llm_kwargs)
        try:
            for prompts, params in batches:
                llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.close()


def prefix_reuse(path: str) -> None:
    from pagedllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    pair = SamplingParams(n=2, temperature=0.8, seed=0, max_tokens=12, ignore_eos=True)
    burst = [SYSTEM + q for q in QUESTIONS[:4]]
    record(
        path,
        dict(num_kv_blocks=32, max_num_seqs=8),
        [(burst, [greedy, greedy, greedy, pair]), ([SYSTEM + QUESTIONS[4]], greedy)],
    )


def preemption(path: str) -> None:
    from pagedllm import SamplingParams

    long = SamplingParams(temperature=0, max_tokens=56, ignore_eos=True)
    record(path, dict(num_kv_blocks=12, max_num_seqs=4), [(QUESTIONS[:4], long)])


PICTURES = {
    "block-trace-prefix-reuse": (prefix_reuse, "A burst behind one system prompt, then a later request"),
    "block-trace-preemption": (preemption, "Four long answers in a 12-block pool: preemption and eviction"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "features", "img"), help="where the SVGs go")
    parser.add_argument("--traces", help="keep the JSON-lines traces in this directory")
    parser.add_argument("--max-blocks", default="32", help="rows drawn at most (keeps each SVG small)")
    parser.add_argument("--record", nargs=2, metavar=("NAME", "TRACE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.record:  # one trace in this process: its seq ids start at 0
        PICTURES[args.record[0]][0](args.record[1])
        return 0
    from pagedllm.entrypoints.cli import main as pagedllm

    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        traces = args.traces or tmp
        os.makedirs(traces, exist_ok=True)
        for name, (_, title) in PICTURES.items():
            trace = os.path.join(traces, name + ".jsonl")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--record", name, trace], check=True)
            svg = os.path.join(args.out, name + ".svg")
            rc = pagedllm(["trace", "view", trace, "-o", svg, "--max-blocks", args.max_blocks, "--title", title])
            if rc:
                return rc
            print(f"{svg}: {os.path.getsize(svg) // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
