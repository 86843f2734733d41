"""A small configuration of every kernel family, for `compute-sanitizer --tool memcheck` (issue 29):

    compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/memcheck.py [--models-dir D]

Through the public API (tiny float32 and bf16 models, small pools that preempt, CUDA graphs):
the KV store, decode attention (split-K chosen by the launcher at batch 1-6: 2 splits at 256 keys)
and prefill attention with and without a cached prefix, the whole-step graphs' padded inputs
(the issue-29 configuration: 2,048-token buckets over max_model_len 256), the piecewise graphs,
sliding windows and soft caps (Gemma 2), fused MoE (Mixtral), fp8 KV, copy-on-write (n = 2),
and the fused sampling kernel (temperature, top-k, top-p). Then the attention kernel directly at
forced split counts 1, 4 and 16 and the fused MoE kernel at 1 and 300 tokens. Prints one line per
case; any invalid access makes the sanitizer exit 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def engine_cases(dirs: dict[str, str]) -> None:
    import torch

    from benchmarks.conformance_models import workload
    from pagedllm import LLM, SamplingParams

    prompts, outs = workload(256)
    prompts, outs = prompts[:4], [min(o, 10) for o in outs[:4]]
    greedy = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=o) for o in outs]
    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1, n=2, ignore_eos=True, max_tokens=6)
    cases = [
        ("whole-step graphs, issue-29 pool", "llama-yarn-issue29", "full", dict(block_size=8, num_kv_blocks=160, max_num_seqs=5)),
        ("whole-step graphs, preempting pool", "qwen3", "full", dict(block_size=16, num_kv_blocks=16, max_num_batched_tokens=64)),
        ("piecewise graphs, block 32", "qwen2", "piecewise", dict(block_size=32, num_kv_blocks=12, max_num_batched_tokens=64)),
        ("eager, prefix hits", "llama", "eager", dict(block_size=8, num_kv_blocks=200)),
        ("windows + soft caps", "gemma2", "full", dict(block_size=16, num_kv_blocks=40, max_num_batched_tokens=64)),
        ("fused MoE", "mixtral", "full", dict(block_size=16, num_kv_blocks=40)),
        ("fp8 KV", "qwen3", "full", dict(block_size=16, num_kv_blocks=24, kv_cache_dtype="fp8")),
        ("bf16", "qwen3", "full", dict(block_size=16, num_kv_blocks=64, dtype="bfloat16")),
    ]  # fmt: skip
    for name, model, mode, kw in cases:
        os.environ["PAGEDLLM_PREFILL_GRAPHS"] = "full" if mode == "eager" else mode
        args = {"device": "cuda", "dtype": "float32", "enforce_eager": mode == "eager", **kw}
        llm = LLM(dirs[model], **args)
        ids = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(ids, greedy, use_tqdm=False)
        llm.generate(ids[:2], sampled, use_tqdm=False)  # the sampling kernel; forks copy-on-write
        torch.cuda.synchronize()
        m = llm.get_metrics()
        assert m["num_free_kv_blocks"] == m["num_kv_blocks"], (name, m)
        print(f"ok  {name} ({model}, {mode}): preemptions {m['num_preemptions']}", flush=True)
        del llm
        torch.cuda.empty_cache()


def kernel_cases() -> None:
    import torch

    from pagedllm.ops.paged_attention import paged_attention_decode

    g = torch.Generator(device="cuda").manual_seed(0)
    dev = "cuda"
    num_blocks, hkv, bs, d, hq = 40, 2, 16, 64, 8
    k = torch.randn(num_blocks, hkv, bs, d, device=dev, generator=g)
    v = torch.randn(num_blocks, hkv, bs, d, device=dev, generator=g)
    seq_lens = torch.tensor([1, 17, 300, 640], dtype=torch.int32, device=dev)
    tables = torch.randperm(num_blocks, device=dev, generator=g)[: 4 * 40 // 4].view(4, 10).to(torch.int32)
    q = torch.randn(4, hq, d, device=dev, generator=g)
    for splits in (1, 4, 16):
        out = paged_attention_decode(q, k, v, tables, seq_lens, 0.125, num_splits=splits)
        torch.cuda.synchronize()
        del out
        print(f"ok  decode attention, {splits} split(s)", flush=True)

    from pagedllm.ops.fused_moe import fused_moe, select_experts

    e, h, inter, topk = 8, 64, 32, 2
    w13 = torch.randn(e, 2 * inter, h, device=dev, generator=g) * 0.1
    w2 = torch.randn(e, h, inter, device=dev, generator=g) * 0.1
    for m in (1, 300):
        x = torch.randn(m, h, device=dev, generator=g)
        weights, ids = select_experts(torch.randn(m, e, device=dev, generator=g), topk, renormalize=True)
        fused_moe(x, w13, w2, weights, ids)
        torch.cuda.synchronize()
        print(f"ok  router + fused MoE, {m} token(s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models-dir", default=os.path.join(tempfile.gettempdir(), "pagedllm-conformance"))
    a = ap.parse_args()
    from benchmarks.conformance_models import write_models

    dirs = write_models(a.models_dir)
    engine_cases(dirs)
    kernel_cases()
    print("memcheck cases done", flush=True)


if __name__ == "__main__":
    main()
