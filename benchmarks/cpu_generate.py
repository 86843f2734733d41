#!/usr/bin/env python3
"""pagedllm vs HF transformers `generate` on CPU, side by side in one process.

Workload: 64 prompts of `--prompt-chars` (160) characters of held-out standard-library
files, 64 new tokens each, greedy, `ignore_eos` (every sequence produces
exactly 64 tokens; HF gets `eos_token_id=None`, so neither side stops or masks EOS).

Held-out files: the default model's validation split. They are read from the model's
`train_log.json` ("val_files", paths relative to the stdlib) when it has one; otherwise the
split is recomputed with `tools/train_default_model.py`'s own `gather_files`/`split_files`
(seed and fraction from train_log.json, else the script's defaults 1234 / 0.05); if that
script is not importable, every 20th file of the sorted stdlib listing is used. The split
holds fewer than 64 files long enough, so a prompt is a snippet: snippet j of a file starts
at the first line start at or after j * 2000 characters; snippets are taken round-robin over
the files in sorted order (every head first, then second snippets, ...) until there are 64.

Both engines get the same token ids (tokenized once, no special tokens), float32 weights,
`torch.set_num_threads(--threads)` (default: os.cpu_count()). HF runs one batch with left
padding (`model.generate`, its default dynamic KV cache); pagedllm runs `LLM.generate` on all
64 at once. Each side does a warm-up, then `--repeats` timed runs, alternating engines; the
best run of each is reported. Output tok/s = 64 * 64 / wall time of one run. The script also
counts the prompts whose 64 tokens are identical token for token in both engines.

The result row is appended to benchmarks/results/cpu.json (a JSON list).

    python benchmarks/cpu_generate.py                 # the bundled default model
    python benchmarks/cpu_generate.py --model DIR --no-save
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import sysconfig
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# run as a script, this directory comes first on sys.path, and its kernels.py would shadow the `kernels`
# package that transformers tries to import (an ImportError, not a missing module, with transformers 5.25)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


# ---- prompts -----------------------------------------------------------------------------
def _train_log(model: str) -> dict:
    try:
        with open(os.path.join(model, "train_log.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def held_out_files(model: str, stdlib: str) -> tuple[list[str], str]:
    """-> (paths relative to stdlib, where the split came from)."""
    log = _train_log(model)
    if log.get("val_files"):
        return sorted(log["val_files"]), "val_files of train_log.json"
    script = os.path.join(REPO, "tools", "train_default_model.py")
    if os.path.isfile(script):
        spec = importlib.util.spec_from_file_location("_train_default_model", script)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        args = log.get("args", {})
        seed, frac = args.get("seed", 1234), args.get("val_fraction", 0.05)
        files, _ = mod.gather_files(stdlib, args.get("keep_generated", False))
        _, val = mod.split_files(files, frac, seed)
        return sorted(r for r, _ in val), f"tools/train_default_model.py split (seed {seed}, fraction {frac})"
    rels = sorted(
        os.path.relpath(os.path.join(d, f), stdlib)
        for d, _, fs in os.walk(stdlib)
        for f in fs
        if f.endswith(".py") and "site-packages" not in d and "/test" not in d
    )
    return rels[::20], "every 20th stdlib file (sorted)"


def make_prompts(model: str, n: int, chars: int, stride: int = 2000) -> tuple[list[str], list[str], str]:
    """`chars`-character snippets of the held-out files: snippet j of a file starts at the
    first line start at or after j * stride. Taken round-robin over the files in sorted order
    (every file's head first, then every file's second snippet, ...) until there are n."""
    stdlib = sysconfig.get_paths()["stdlib"]
    rels, source = held_out_files(model, stdlib)
    texts = {}
    for rel in rels:
        try:
            with open(os.path.join(stdlib, rel), encoding="utf-8", errors="replace") as f:
                texts[rel] = f.read().replace("\r\n", "\n")
        except OSError:
            continue
    prompts, used = [], []
    for j in range(max(len(t) for t in texts.values()) // stride + 1):
        for rel, text in texts.items():
            start = 0 if j == 0 else text.find("\n", j * stride - 1) + 1
            if start <= 0 and j > 0 or len(text) - start < chars:
                continue
            prompts.append(text[start : start + chars])
            used.append(f"{rel}@{start}")
            if len(prompts) == n:
                return prompts, used, source
    raise SystemExit(f"only {len(prompts)} snippets of >= {chars} characters in the held-out files ({source})")


# ---- engines -----------------------------------------------------------------------------
def run_pagedllm(llm, prompt_ids, max_tokens):
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, [list(o.outputs[0].token_ids) for o in outs]


def run_hf(model, prompt_ids, max_tokens, pad_id):
    import torch

    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, ids in enumerate(prompt_ids):  # left padding
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        mask[i, width - len(ids) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
    dt = time.perf_counter() - t0
    return dt, out[:, width:].tolist()


def load_hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    except TypeError:  # transformers < 4.56
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    gc = model.generation_config  # greedy, no early stop
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    gc.eos_token_id = None
    return model


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO, timeout=10)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=10,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    import pagedllm

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default=pagedllm.default_model_path())
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-chars", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine (alternating); best is kept")
    p.add_argument("--results", default=os.path.join(REPO, "benchmarks", "results", "cpu.json"))
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--profile", metavar="FILE", help="cProfile one extra pagedllm run into FILE (pstats)")
    p.add_argument("--label", default="", help="free text stored with the row")
    args = p.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoTokenizer

    from pagedllm import LLM

    torch.set_num_threads(args.threads)

    prompts, files, source = make_prompts(args.model, args.num_prompts, args.prompt_chars)
    tok = AutoTokenizer.from_pretrained(args.model)
    prompt_ids = [tok.encode(t, add_special_tokens=False) for t in prompts]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    lens = [len(x) for x in prompt_ids]
    print(
        f"{len(prompts)} prompts from {source}: {min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.1f}), "
        f"{args.max_tokens} new tokens each, {args.threads} threads",
        flush=True,
    )

    block_size = 16
    blocks = sum(-(-(n + args.max_tokens) // block_size) for n in lens) + 16
    llm = LLM(args.model, device="cpu", dtype="float32", num_kv_blocks=blocks, block_size=block_size)
    hf = load_hf(args.model)

    warm = prompt_ids[:8]  # warm-up: same shapes' code paths
    run_pagedllm(llm, warm, 8)
    run_hf(hf, warm, 8, pad_id)

    load_before = os.getloadavg()[0]
    times = {"pagedllm": [], "hf": []}
    out_p = out_h = None
    for _ in range(args.repeats):
        dt, out_p = run_pagedllm(llm, prompt_ids, args.max_tokens)
        times["pagedllm"].append(dt)
        dt, out_h = run_hf(hf, prompt_ids, args.max_tokens, pad_id)
        times["hf"].append(dt)
        print(f"  pagedllm {times['pagedllm'][-1]:.2f} s   hf {times['hf'][-1]:.2f} s", flush=True)
    assert all(len(o) == args.max_tokens for o in out_p + out_h), "an engine stopped early"
    load_after = os.getloadavg()[0]
    if max(load_before, load_after) > args.threads + 0.5:
        print(
            f"warning: 1-minute load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} CPUs: "
            "other processes compete for the cores, the numbers are unreliable",
            flush=True,
        )

    total = args.num_prompts * args.max_tokens
    tps = {k: total / min(v) for k, v in times.items()}
    ratio = tps["pagedllm"] / tps["hf"]
    identical = sum(a == b for a, b in zip(out_p, out_h, strict=False))
    first_diff = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        for a, b in zip(out_p, out_h, strict=False)
    ]
    print(
        f"pagedllm: {tps['pagedllm']:.1f} output tok/s   HF transformers: {tps['hf']:.1f} output tok/s   "
        f"ratio {ratio:.2f}x"
    )
    print(f"identical outputs (all {args.max_tokens} tokens): {identical}/{args.num_prompts}")

    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        run_pagedllm(llm, prompt_ids, args.max_tokens)
        prof.disable()
        prof.dump_stats(args.profile)
        print(f"profile of one pagedllm run written to {args.profile}")

    row = {
        "benchmark": "cpu_generate",
        "model": os.path.abspath(args.model),
        "num_prompts": args.num_prompts,
        "prompt_chars": args.prompt_chars,
        "max_tokens": args.max_tokens,
        "prompt_tokens_min_mean_max": [min(lens), round(sum(lens) / len(lens), 1), max(lens)],
        "prompt_source": source,
        "prompt_files": files,
        "dtype": "float32",
        "threads": args.threads,
        "repeats": args.repeats,
        "pagedllm": {
            "output_tok_per_s": round(tps["pagedllm"], 2),
            "seconds": [round(t, 3) for t in times["pagedllm"]],
        },
        "hf": {
            "output_tok_per_s": round(tps["hf"], 2),
            "seconds": [round(t, 3) for t in times["hf"]],
            "settings": "model.generate, batch of all prompts, left padding, dynamic cache, greedy",
        },
        "ratio": round(ratio, 3),
        "identical_outputs": identical,
        "first_divergence_positions": [d for d in first_diff if d is not None],
        "commit": git_commit(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_avg_1min_before_after": [round(load_before, 2), round(load_after, 2)],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "label": args.label,
    }
    if not args.no_save:
        rows = []
        if os.path.exists(args.results):
            with open(args.results) as f:
                rows = json.load(f)
        rows.append(row)
        os.makedirs(os.path.dirname(args.results), exist_ok=True)
        with open(args.results, "w") as f:
            json.dump(rows, f, indent=1)
            f.write("\n")
        print(f"appended to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
