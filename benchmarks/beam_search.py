#!/usr/bin/env python3
"""Beam search speed: pagedllm vs HF transformers `generate(num_beams=W)`, same weights, one process.

Workload (defaults: the H200 run): `--num-prompts` 64 prompts of `--input-len` 512 random token ids,
beam width `--beam-width` 4, `--output-len` 128 new tokens that EOS cannot cut short:
  pagedllm  LLM.generate(prompts, SamplingParams(use_beam_search=True, n=W, temperature=0,
            max_tokens=N, ignore_eos=True)): every request in flight at once; the W beams of a
            request share blocks (fork, copy-on-write on a split partial block)
  hf        model.generate(input_ids, num_beams=W, num_return_sequences=1, do_sample=False,
            max_new_tokens=N, length_penalty=1.0, early_stopping=False, eos_token_id=<one past
            the vocabulary>: HF's counterpart of ignore_eos, EOS an ordinary token),
            batches of `--hf-batch-size` prompts (all prompts have the same length: no padding),
            halved on out-of-memory and timed again from the start
Each engine first runs a warm-up (one short prompt); then `--repeat` timed runs, the median reported. Reported per engine: wall
seconds, tokens/s of the best beam (num_prompts x output_len / wall), and the ratio pagedllm/HF.
pagedllm runs first and is closed (weights and KV tensor freed) before HF loads the same
directory in the same dtype (`--dtype auto`: bf16 on a GPU, float32 on the CPU).

Agreement: how many prompts' best beam (token ids) equal HF's, and the largest score difference
on those (HF's `sequences_scores`, pagedllm's CompletionOutput.score). In float32 they should
agree for almost every prompt (ties and near-ties in the logits may flip one); in bf16 the two
engines' rounding differs and beams diverge, so disagreement is reported, never fatal.

Rows go to benchmarks/results/beam-search-<gpu>.json (`--results-dir`) with the commit, GPU and
library versions.

    python benchmarks/beam_search.py --model /tmp/qwen3-0.6b-random                  # H200
    python benchmarks/beam_search.py --num-prompts 16 --input-len 128 --output-len 32  # CPU, bundled model
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time


def add_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.args import add_engine_args

    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=64, help="prompts (default: 64)")
    p.add_argument("--input-len", type=int, default=512, help="random prompt tokens each (default: 512)")
    p.add_argument("--output-len", type=int, default=128, help="new tokens per beam, EOS ignored (default: 128)")
    p.add_argument("--beam-width", type=int, default=4, help="beams per prompt (default: 4)")
    p.add_argument(
        "--hf-batch-size", type=int, default=None, help="prompts per HF generate call (default: all; halved on OOM)"
    )
    p.add_argument("--skip-hf", action="store_true", help="run pagedllm only")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per engine; the median is reported (default: 3)")
    p.add_argument("--prompt-seed", type=int, default=0, help="seeds the random prompts (default: 0)")
    p.add_argument("--results-dir", default="benchmarks/results", help="(default: benchmarks/results)")
    p.add_argument("--no-save", action="store_true", help="print only; append nothing to the results directory")
    p.add_argument("--out", help="also write this run's row as JSON to this file")
    p.add_argument("--label", default="", help="free text stored with the row")


def run_pagedllm(llm, prompts: list[list[int]], args) -> tuple[float, list[list[int]], list[float]]:
    """Wall seconds of one LLM.generate over all prompts, and each prompt's best beam and its score."""
    from pagedllm import SamplingParams

    params = SamplingParams(
        n=args.beam_width, use_beam_search=True, temperature=0.0, max_tokens=args.output_len, ignore_eos=True
    )
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    best = [o.outputs[0] for o in outs]
    assert all(len(o.outputs) == args.beam_width for o in outs)
    assert all(len(c.token_ids) == args.output_len for c in best), "ignore_eos: every beam runs to --output-len"
    return wall, [list(c.token_ids) for c in best], [float(c.score) for c in best]


def hf_generate(model, ids, args):
    """HF beam search with pagedllm's ignore_eos: EOS an ordinary token that ends nothing. HF has no
    such flag; its end-of-sequence id is set to one past the vocabulary, an id no step can pick,
    so every beam runs to max_new_tokens and EOS competes like any other token (min_new_tokens
    would instead mask EOS, and the beams would differ wherever EOS is among the candidates)."""
    import torch
    from transformers import GenerationConfig

    never = model.config.vocab_size
    config = GenerationConfig(
        num_beams=args.beam_width,
        num_return_sequences=1,
        do_sample=False,
        max_new_tokens=args.output_len,
        length_penalty=1.0,
        early_stopping=False,
        eos_token_id=never,
        pad_token_id=never,
        return_dict_in_generate=True,
        output_scores=True,
    )
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    assert out.sequences.shape[1] == ids.shape[1] + args.output_len
    return out


def run_hf(model, prompts: list[list[int]], args, batch: int):
    """Wall seconds of HF beam search over all prompts in batches of `batch` (halved and timed again
    on out-of-memory), the batch size that fit, each prompt's best beam and its score."""
    import torch

    device = next(model.parameters()).device
    while True:
        try:
            t = time.perf_counter()
            best, scores = [], []
            for i in range(0, len(prompts), batch):
                ids = torch.tensor(prompts[i : i + batch], device=device)
                out = hf_generate(model, ids, args)
                best += out.sequences[:, ids.shape[1] :].tolist()
                scores += out.sequences_scores.float().tolist()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - t, batch, best, scores
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
            batch = max(1, batch // 2)
            print(f"HF: out of memory, batch size {batch}", file=sys.stderr)
            if device.type == "cuda":
                torch.cuda.empty_cache()


def free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_row(walls: list[float], tokens: int) -> dict:
    """The median run's wall seconds and best-beam tok/s, and every run's wall."""
    wall = statistics.median(walls)
    return {
        "wall_s": round(wall, 4),
        "best_beam_tokens_per_s": round(tokens / wall, 1),
        "wall_s_all": [round(w, 4) for w in walls],
    }


def main(args) -> int:
    from pagedllm import LLM
    from pagedllm.bench.common import environment, gpu_slug, save_results
    from pagedllm.entrypoints.args import engine_kwargs
    from pagedllm.entrypoints.model_dir import eos_token_ids
    from pagedllm.worker.device import resolve_device, resolve_dtype

    if min(args.num_prompts, args.input_len, args.output_len, args.beam_width, args.repeat) < 1:
        raise ValueError("--num-prompts, --input-len, --output-len, --beam-width and --repeat must be >= 1")
    if args.hf_batch_size is not None and args.hf_batch_size < 1:
        raise ValueError("--hf-batch-size must be >= 1")
    env = environment()
    kwargs = engine_kwargs(args)
    llm = LLM(**kwargs)
    model_dir, hf_config = llm.model_path, llm.hf_config
    eos = sorted(eos_token_ids(model_dir, hf_config, llm.tokenizer))
    dtype = resolve_dtype(kwargs.get("dtype", "auto"), hf_config, resolve_device(kwargs.get("device", "auto")))
    vocab = hf_config.vocab_size
    rng = random.Random(args.prompt_seed)
    special = set(eos)
    prompts = [
        [t for t in (rng.randrange(vocab) for _ in range(args.input_len * 2)) if t not in special][: args.input_len]
        for _ in range(args.num_prompts)
    ]
    tokens = args.num_prompts * args.output_len
    warm = argparse.Namespace(**{**vars(args), "output_len": 4})
    run_pagedllm(llm, [prompts[0][:16]], warm)
    runs = []
    for _ in range(args.repeat):
        llm.reset_prefix_cache()  # every timed run prefills its prompts (a later one would hit the first's)
        runs.append(run_pagedllm(llm, prompts, args))
    walls, (_, ours, our_scores) = [r[0] for r in runs], runs[0]
    same_beams = all(r[1] == ours for r in runs)  # float32: always; bf16: equal inputs give equal beams
    wall = statistics.median(walls)
    row: dict = {
        "benchmark": "beam_search",
        "model": os.path.basename(os.path.normpath(model_dir)),
        "dtype": str(dtype).replace("torch.", ""),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "beam_width": args.beam_width,
        "repeat": args.repeat,
        "pagedllm": {**engine_row(walls, tokens), "async_scheduling": llm.engine.async_scheduling},
        "same_beams_every_run": same_beams,
    }
    llm.close()
    del llm
    free_device_memory()
    if not args.skip_hf:
        import torch
        from transformers import AutoModelForCausalLM

        device = resolve_device(kwargs.get("device", "auto"))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        hf_generate(model, torch.tensor([prompts[0][:16]], device=device), warm)
        batch = args.hf_batch_size or len(prompts)
        hf_walls = []
        for _ in range(args.repeat):
            hf_time, batch, theirs, their_scores = run_hf(model, prompts, args, batch)
            hf_walls.append(hf_time)
        hf_wall = statistics.median(hf_walls)
        same = [i for i in range(len(prompts)) if ours[i] == theirs[i]]
        row["hf"] = {**engine_row(hf_walls, tokens), "batch_size": batch}
        row["speedup_vs_hf"] = round(hf_wall / wall, 3)
        row["best_beam_equal_hf"] = f"{len(same)}/{len(prompts)}"
        row["max_score_diff_where_equal"] = (
            round(max(abs(our_scores[i] - their_scores[i]) for i in same), 6) if same else None
        )
        del model
        free_device_memory()
    row.update(label=args.label, **env)
    print(f"{'engine':<9} {'wall s':>8} {'best-beam tok/s':>16}")
    for name in ("pagedllm", "hf"):
        if name in row:
            print(f"{name:<9} {row[name]['wall_s']:>8.3f} {row[name]['best_beam_tokens_per_s']:>16.1f}")
    if "hf" in row:
        print(
            f"pagedllm / HF: {row['speedup_vs_hf']}x; best beam equal to HF's on {row['best_beam_equal_hf']} prompts "
            f"(max score difference there {row['max_score_diff_where_equal']}; {row['dtype']})"
        )
    save_results(row, args, f"beam-search-{gpu_slug(env['gpu'])}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    sys.exit(main(parser.parse_args()))
