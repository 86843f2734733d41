"""Host time of the engine's steps (CUDA): where a step that admits a new prompt spends it.

A few long decodes run while, every `--every` steps, a new prompt of `--input-len` tokens
arrives (as at 16 req/s on the serving benchmark). Each `LLMEngine.step()` is timed; the steps
that schedule a prefill run under cProfile, and the functions with the most time in them are
printed and written (JSON), beside the median wall time of prefill and decode-only steps.

    python benchmarks/step_profile.py --model /tmp/qwen3-0.6b --out step_profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.bench.common import environment  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--decodes", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--every", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--out", default=None)
    ap.add_argument("--llm-args", default="{}", help="JSON of extra LLM arguments")
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device, max_model_len=2048, **json.loads(args.llm_args))
    e = llm.engine
    vocab = e.vocab_size
    long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(args.decodes):
        e.add_request(f"long-{i}", [(13 * i + 7 * j) % (vocab - 10) + 5 for j in range(64)], long)
    for _ in range(30):
        e.step()
    prof = cProfile.Profile()
    prefill_ms, decode_ms = [], []
    added = 0
    k = 0
    while added < args.prompts:
        if k % args.every == 0:
            e.add_request(
                f"p-{added}", [(31 * added + 11 * j) % (vocab - 10) + 5 for j in range(args.input_len)], short
            )
            added += 1
            profiled = added > 3  # the first ones may compile kernels
            if profiled:
                prof.enable()
            t = time.perf_counter()
            e.step()
            dt = time.perf_counter() - t
            if profiled:
                prof.disable()
                prefill_ms.append(dt * 1000)
        else:
            t = time.perf_counter()
            e.step()
            decode_ms.append((time.perf_counter() - t) * 1000)
        k += 1
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_stats(30)
    text = s.getvalue()
    print(text)
    res = {
        "benchmark": "step_profile",
        "config": vars(args),
        "prefill_step_ms": {
            "median": round(statistics.median(prefill_ms), 3),
            "all": [round(x, 3) for x in prefill_ms],
        },
        "decode_step_ms": {"median": round(statistics.median(decode_ms), 3)},
        "profile": text[:60000],
        **environment(),
    }
    print("prefill steps (admitting a prompt):", res["prefill_step_ms"]["median"], "ms; decode-only",
          res["decode_step_ms"]["median"], "ms")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
