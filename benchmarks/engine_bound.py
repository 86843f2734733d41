"""The serving benchmark's all-at-once workload without a server: the engine's ceiling.

`pagedllm bench serve --request-rate inf` sends N random token-id prompts of --input-len tokens,
each generating exactly --output-len tokens. This runs the same prompts (the same generator and
seed) through LLM.generate, all submitted at once, and prints the requests per second the engine
alone reaches: what the server could reach if HTTP, output processing and SSE cost nothing.

    python benchmarks/engine_bound.py --model DIR [--device cuda] [--num-prompts 500]
        [--input-len 512] [--output-len 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.bench.common import environment  # noqa: E402
from pagedllm.bench.workload import random_prompts  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--num-prompts", type=int, default=500)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=None, help="write the result as JSON")
    args = p.parse_args()
    prompts = random_prompts(args.model, args.num_prompts, args.input_len, args.seed)
    llm = LLM(args.model, device=args.device)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {
        "benchmark": "engine_bound",
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seconds": round(seconds, 3),
        "requests_per_s": round(args.num_prompts / seconds, 1),
        "output_tokens_per_s": round(tokens / seconds, 1),
        **environment(),
    }
    print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    llm.close()


if __name__ == "__main__":
    main()
