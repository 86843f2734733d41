"""quantization="fp8" on the GPU (issue 33, first step): greedy decode of 256 prompts (100-355
random ids, 128 tokens each) with bf16 weights, fp8 weights eager, fp8 weights with CUDA graphs;
tok/s, weight GiB, and how many of the 256 outputs graphs and eager agree on. JSON to $OUT.

    OUT=DIR python benchmarks/fp8_weights.py MODEL_DIR
"""

import json
import os
import sys
import time

import torch

from pagedllm import LLM, SamplingParams

M = sys.argv[1]
rows = []
prompts = [
    {"prompt_token_ids": [int(x) for x in torch.randint(0, 8000, (n,), generator=torch.Generator().manual_seed(n))]}
    for n in range(100, 100 + 256)
]
greedy = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
ref = None
for q, eager in ((None, False), ("fp8", True), ("fp8", False)):
    llm = LLM(M, quantization=q, enforce_eager=eager, kv_cache_memory_bytes=8 << 30, max_model_len=1024)
    llm.generate(prompts[:8], greedy, use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    dt = time.perf_counter() - t
    toks = [o.outputs[0].token_ids for o in outs]
    if q == "fp8" and eager:
        ref = toks
    same = None if ref is None or eager else sum(a == b for a, b in zip(ref, toks, strict=True))
    rows.append(
        dict(
            quantization=q,
            enforce_eager=eager,
            weights_gib=llm.runner.weights_bytes / 2**30,
            tok_s=256 * 128 / dt,
            seconds=dt,
            graphs_equal_eager_of_256=same,
            startup=llm.startup_seconds.get("fp8 weights"),
        )
    )
    print(json.dumps(rows[-1]), flush=True)
    del llm
    torch.cuda.empty_cache()
json.dump(
    dict(
        rows=rows, torch=torch.__version__, gpu=torch.cuda.get_device_name(), commit=os.environ.get("PAGEDLLM_COMMIT")
    ),
    open(os.path.join(os.environ["OUT"], "fp8-weights.json"), "w"),
    indent=1,
)
