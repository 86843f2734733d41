#!/usr/bin/env python3
"""Speculative decoding: TPOT with and without it, at several batch sizes, on a copy-heavy workload
and on random prompts (docs/features/speculative-decoding.md). `--methods` (default: ngram):
  ngram        prompt lookup, `--k` proposals
  draft-self   the target as its own draft model: every proposal is accepted (greedy), so this row
               bounds the draft machinery's overhead against its best case
  draft-small  the target's first `--draft-layers` layers (with its embedding, final norm and head)
               as the draft, written once to `--draft-dir` (a layer-skip draft: same vocabulary,
               a fraction of the cost, modest acceptance)
Draft rows run for each k in `--draft-ks` (default: the single `--k`), which gives throughput
against k.

Workloads (`--workloads`):
  copy    each prompt is a random phrase of `--phrase-len` tokens repeated `--repeats` times: a
          model that continues the repetition (trained models do; random-weight ones often fall
          into loops of their own) emits what prompt lookup proposes, so acceptance is high
  random  `--input-len` random token ids: proposals are rare and mostly rejected (acceptance ~0)
  code    a code edit, for a trained model (the bundled one): a chunk of about `--input-len` tokens
          of one of pagedllm's own source files, then a line saying it comes again, then its first
          16 tokens; a model that copies (induction) continues with the chunk
Each (workload, batch) runs with speculation off and with `--k` proposals (`--spec-config` for
the other keys), batch = requests submitted at once (`--batches`, default 1 8 64), each
`--output-len` new tokens with EOS ignored, greedy (or `--temperature`, request i seeded with i:
a seeded request draws the same tokens with speculation, so the outputs still compare). One
warm-up generate per engine first; then `--repeat` timed runs, the median reported. The defaults
(four engines: none, ngram, draft-self, draft-small) are sized to finish in a few minutes on one
H200; choose fewer with the flags above.

Reported per row: TPOT (mean over the requests of (finish - first token) / (tokens - 1), in ms),
output tokens/s (all requests' tokens over the wall time), and with speculation the acceptance
rate, the mean acceptance length (tokens per verification row) and the drafts' share of steps
(from get_metrics(), deltas over the timed runs), plus `greedy_equal`: the speculative outputs equal
the plain ones token for token (they must in float32; in bf16 a verification step's rows round
differently from a decode step's, as a different batch does, so near-ties can go the other way:
`equal_prefix_share` is the mean share of each output before its first difference, and
`alone_equal` says whether the batch's first prompt, run alone, gave the output it got in the
batch: the same rounding effect without speculation). Rows (JSON lines) go to `--out` with the commit, GPU
and library versions.

    python benchmarks/spec_decode.py --model /tmp/qwen3-0.6b --out $OUT/spec_decode.jsonl       # H200
    python benchmarks/spec_decode.py --model /tmp/qwen3-0.6b --methods draft-self draft-small \
        --workloads random --draft-ks 2 4 --out $OUT/spec_draft.jsonl                         # H200, drafts
    python benchmarks/spec_decode.py --batches 1 4 --output-len 32 --input-len 64 --repeat 1    # CPU, bundled model
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import sys
import time

SPEC_KEYS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def parse_args(argv=None) -> argparse.Namespace:
    from pagedllm.entrypoints.args import add_engine_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--workloads", nargs="+", default=["copy", "random"], choices=["copy", "random", "code"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64], help="requests at once (default: 1 8 64)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default: 4)")
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="speculative_config.disable_by_batch_size (default: none, so every batch proposes)",
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy; else request i is seeded with i (default: 0)"
    )
    p.add_argument("--output-len", type=int, default=128, help="new tokens per request, EOS ignored (default: 128)")
    p.add_argument("--input-len", type=int, default=512, help="random workload: prompt tokens (default: 512)")
    p.add_argument("--phrase-len", type=int, default=64, help="copy workload: the repeated phrase (default: 64)")
    p.add_argument("--repeats", type=int, default=8, help="copy workload: repetitions in the prompt (default: 8)")
    p.add_argument("--repeat", type=int, default=2, help="timed runs per point; the median (default: 2)")
    p.add_argument("--prompt-seed", type=int, default=0, help="seeds the prompts (default: 0)")
    p.add_argument(
        "--methods",
        nargs="+",
        default=["ngram", "draft-self", "draft-small"],
        choices=["ngram", "draft-self", "draft-small"],
        help="(default: all three)",
    )
    p.add_argument("--draft-ks", nargs="+", type=int, help="draft methods: the k's to run (default: --k)")
    p.add_argument("--draft-layers", type=int, default=4, help="draft-small: the target's layers kept (default: 4)")
    p.add_argument("--draft-dir", default="/tmp/pagedllm-spec-draft", help="draft-small: where it is written")
    p.add_argument("--out", help="append the rows here as JSON lines")
    p.add_argument("--label", default="", help="free text stored with the rows")
    return p.parse_args(argv)


def code_prompts(n: int, tokenizer, args) -> list[list[int]]:
    """`n` code-edit prompts from pagedllm's own source files (sorted, so the same ones each run)."""
    from pathlib import Path

    import pagedllm

    files = sorted(Path(pagedllm.__file__).parent.rglob("*.py"))
    rng = random.Random(f"{args.prompt_seed}-code-{n}")
    out = []
    while len(out) < n:
        ids = tokenizer.encode(rng.choice(files).read_text())
        if len(ids) < args.input_len + 32:
            continue
        start = rng.randrange(len(ids) - args.input_len)
        chunk = ids[start : start + args.input_len]
        out.append(chunk + tokenizer.encode("\n\n# the same code again:\n") + chunk[:16])
    return out


def make_prompts(workload: str, n: int, vocab: int, args, tokenizer=None) -> list[list[int]]:
    if workload == "code":
        return code_prompts(n, tokenizer, args)
    rng = random.Random(f"{args.prompt_seed}-{workload}-{n}")
    lo = min(1000, vocab // 4)  # away from special ids
    if workload == "random":
        return [[rng.randrange(lo, vocab) for _ in range(args.input_len)] for _ in range(n)]
    return [[rng.randrange(lo, vocab) for _ in range(args.phrase_len)] * args.repeats for _ in range(n)]


def timed(llm, prompts: list[list[int]], args) -> tuple[float, float, list[list[int]]]:
    """Wall seconds, mean TPOT (s) and the outputs of one generate over all prompts at once."""
    from pagedllm import SamplingParams

    params = [
        SamplingParams(temperature=args.temperature, seed=i, max_tokens=args.output_len, ignore_eos=True)
        for i in range(len(prompts))
    ]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t
    tpots = []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if m is not None and m.first_token_time is not None and m.finish_time is not None and n > 1:
            tpots.append((m.finish_time - m.first_token_time) / (n - 1))
    return wall, statistics.mean(tpots), [list(o.outputs[0].token_ids) for o in outs]


def point(llm, spec: dict | None, workload: str, batch: int, vocab: int, args) -> dict:
    """One (workload, batch) row: the median of --repeat timed runs; metrics deltas over them."""
    prompts = make_prompts(workload, batch, vocab, args, llm.tokenizer)
    before = llm.get_metrics()
    runs = [timed(llm, prompts, args) for _ in range(args.repeat)]
    after = llm.get_metrics()
    wall = statistics.median(r[0] for r in runs)
    # the first prompt alone: is its output the one it got in the batch? (bf16: not always, as
    # rows round differently in a different batch; float32: always)
    alone = timed(llm, prompts[:1], args)[2][0] == runs[0][2][0] if batch > 1 else True
    drafts, proposed, accepted = (after.get(k, 0) - before.get(k, 0) for k in SPEC_KEYS)
    return {
        "workload": workload,
        "batch": batch,
        "speculative": spec is not None,
        "k": 0 if spec is None else spec["num_speculative_tokens"],
        "tpot_ms": 1e3 * statistics.median(r[1] for r in runs),
        "output_tok_s": batch * args.output_len / wall,
        "wall_s": wall,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
        "num_drafts": drafts,
        "outputs": runs[0][2],
        "alone_equal": alone,
    }


def equal_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def truncated_draft(model_dir: str, out_dir: str, num_layers: int) -> str:
    """Write the model's first `num_layers` decoder layers (with its embedding, final norm and LM
    head, and its tokenizer files) as a model of its own: a draft of the same vocabulary."""
    from safetensors.torch import load_file, save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:num_layers]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    kept = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        for name, t in load_file(path).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            kept[name] = t.contiguous()
    save_file(kept, os.path.join(out_dir, "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(model_dir, name)):
            with open(os.path.join(model_dir, name), "rb") as src, open(os.path.join(out_dir, name), "wb") as dst:
                dst.write(src.read())
    return out_dir


def spec_configs(args, model_dir: str) -> list[tuple[str, dict]]:
    """(method, speculative_config) per engine to run, in --methods order."""
    out: list[tuple[str, dict]] = []
    for method in args.methods:
        if method == "ngram":
            lookup = {"prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
            limit = {"disable_by_batch_size": args.disable_by_batch_size}
            out.append((method, {"method": "ngram", "num_speculative_tokens": args.k, **lookup, **limit}))
            continue
        draft = model_dir if method == "draft-self" else truncated_draft(model_dir, args.draft_dir, args.draft_layers)
        limit = {"disable_by_batch_size": args.disable_by_batch_size}
        out += [(method, {"model": draft, "num_speculative_tokens": k, **limit}) for k in args.draft_ks or [args.k]]
    return out


def run_engine(spec: dict | None, args, engine_kw: dict) -> list[dict]:
    from pagedllm import LLM

    rows = []
    with LLM(**engine_kw, speculative_config=spec) as llm:
        vocab = llm.hf_config.vocab_size
        timed(llm, make_prompts("copy", 1, vocab, args)[:1], args)  # warm-up
        for workload in args.workloads:
            for batch in args.batches:
                rows.append(point(llm, spec, workload, batch, vocab, args))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "outputs"}), file=sys.stderr)
    return rows


def main(argv=None) -> None:
    from pagedllm.bench.common import environment
    from pagedllm.entrypoints.args import engine_kwargs

    args = parse_args(argv)
    engine_kw = engine_kwargs(args)
    engine_kw.pop("speculative_config", None)
    plain = run_engine(None, args, engine_kw)
    env = environment()
    lines = []
    for a in plain:
        a["greedy_equal"], a["equal_prefix_share"], a["tpot_speedup"], a["method"] = True, 1.0, 1.0, "none"
        lines.append(_line(a, args, engine_kw, env))
    for method, spec in spec_configs(args, engine_kw["model"]):
        for a, b in zip(plain, run_engine(spec, args, engine_kw), strict=True):
            b["greedy_equal"] = a["outputs"] == b["outputs"]
            b["equal_prefix_share"] = statistics.mean(
                equal_prefix(x, y) / max(len(x), 1) for x, y in zip(a["outputs"], b["outputs"], strict=True)
            )
            b["tpot_speedup"] = a["tpot_ms"] / b["tpot_ms"]
            b["method"] = method
            lines.append(_line(b, args, engine_kw, env))
    if args.out:
        with open(args.out, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


def _line(row: dict, args, engine_kw: dict, env: dict) -> dict:
    out = {k: v for k, v in row.items() if k != "outputs"}
    out.update(bench="spec_decode", output_len=args.output_len, label=args.label, **env)
    out["engine"] = {k: v for k, v in engine_kw.items() if k != "model"}
    out["model"] = engine_kw["model"]
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
