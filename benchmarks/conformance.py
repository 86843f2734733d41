"""The GPU conformance matrix (issue 29): every cell of benchmarks/conformance_models.py through
the public API (`LLM.generate`, greedy, ignore_eos, float32), checked against an independent
implementation, in worker processes on one GPU.

    python benchmarks/conformance.py --out DIR [--workers 8] [--sweep 50] [--only REGEX]

A cell passes when it raises nothing (no CUDA error), every pool block is free again at the end,
and every generated token is the reference's greedy choice for the sequence so far, teacher-forced
on the cell's own output, with near-ties as the CPU tests treat them (the token taken may differ
from the reference's argmax only where its logit is within TIE of the top one):
- matrix / repro cells: HF transformers, float32 on CPU, over each whole output sequence;
- fp8 cells: pagedllm's CPU fp8 path (torch references) with the GPU run's KV scales, through
  prompt_logprobs (its log-probabilities within FP8_TIE);
- sweep cells: the same configuration run eager; where the tokens differ, both runs must pass
  the HF check (a near-tie took them apart), else the cell fails.
Rows: DIR/conformance.jsonl (one per cell, refused and unrun cells included) and
DIR/conformance-summary.json. A worker that dies (a CUDA error kills its context) fails the cell
it was running and leaves the rest of its chunk as "not run": they count as failures too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the repository root instead of benchmarks/ (whose kernels.py would shadow the `kernels` package
# that transformers imports)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

TIE = 1e-3  # logits (HF, fp32): the token taken may trail the top logit by this much
FP8_TIE = 0.1  # log-probabilities (CPU fp8 path): quantization rounds a few K/V codes differently
CHUNK = 12  # cells per worker process (they share its model cache)


# ---- worker side ------------------------------------------------------------------------------
class References:
    """Per model: HF's logits over a sequence (cached), and pagedllm's CPU fp8 engine."""

    def __init__(self):
        self.hf: dict[str, object] = {}
        self.cache: dict[tuple[str, tuple[int, ...]], object] = {}

    def hf_worst(self, path: str, prompt: list[int], out: list[int]) -> float:
        """max over generated positions of (top logit - logit of the token taken), HF fp32 CPU."""
        import torch
        from transformers import AutoModelForCausalLM

        if path not in self.hf:
            self.hf[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        key = (path, tuple(prompt + out))
        if key not in self.cache:
            with torch.inference_mode():
                logits = self.hf[path](torch.tensor([prompt + out])).logits[0].float()  # type: ignore[operator]
            rows = logits[len(prompt) - 1 : len(prompt) + len(out) - 1]
            taken = rows.gather(1, torch.tensor(out)[:, None])[:, 0]
            self.cache[key] = float((rows.max(1).values - taken).max()) if out else 0.0
        return self.cache[key]  # type: ignore[return-value]

    def fp8_worst(self, path: str, scales, block_size: int, prompt: list[int], out: list[int]) -> float:
        """max over generated positions of (top logprob - logprob of the token taken), CPU fp8."""
        from pagedllm import LLM, SamplingParams

        key = ("fp8:" + path + str(scales), tuple(prompt + out))
        if key in self.cache:
            return self.cache[key]  # type: ignore[return-value]
        ek = "fp8-engine:" + path + str(scales)
        if ek not in self.hf:
            cpu = LLM(path, device="cpu", kv_cache_dtype="fp8", num_kv_blocks=256, block_size=16)
            for layer, (k, v) in zip(cpu.runner.attn_layers, scales, strict=True):  # the GPU's bytes
                layer.set_kv_scales(k, v)
            cpu.runner.kv_scales = list(scales)
            self.hf[ek] = cpu
        cpu = self.hf[ek]
        params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
        res = cpu.generate([{"prompt_token_ids": prompt + out}], params, use_tqdm=False)[0]  # type: ignore[attr-defined]
        worst = 0.0
        for pos, tok in enumerate(out, start=len(prompt)):
            entry = res.prompt_logprobs[pos]
            top = max(lp.logprob for lp in entry.values())
            worst = max(worst, top - entry[tok].logprob)
        self.cache[key] = worst
        return worst


def need_one(model_dir: str, longest: int):
    from pagedllm.engine.kv_cache_groups import blocks_per_sequence, kv_cache_groups
    from pagedllm.entrypoints.model_dir import load_hf_config
    from pagedllm.model.registry import layer_windows

    groups = kv_cache_groups(layer_windows(load_hf_config(model_dir)))
    return lambda bs, chunk: blocks_per_sequence(groups, longest, bs, chunk)


def engine_args(cell: dict, model_dir: str, prompts, outs) -> dict:
    from benchmarks.conformance_models import MAX_NUM_SEQS, pool_settings

    longest = max(len(p) + o for p, o in zip(prompts, outs, strict=True))
    args = dict(
        device=os.environ.get("CONFORMANCE_DEVICE", "cuda"),
        dtype="float32",
        max_num_seqs=MAX_NUM_SEQS,
        enforce_eager=cell["graphs"] == "eager",
    )
    if cell["kind"] == "sweep":
        eng = dict(cell["engine"])
        slack = eng.pop("pool_slack")
        chunk = min(eng["max_num_batched_tokens"], longest)
        eng["num_kv_blocks"] = need_one(model_dir, longest)(eng["block_size"], chunk) + slack
        return {**args, **eng}
    if cell["kind"] == "repro":
        return {**args, **cell["engine"], "async_scheduling": cell["async_scheduling"]}
    pool = pool_settings(cell["pool"], need_one(model_dir, longest))
    args.update(pool, enable_prefix_caching=cell["prefix_caching"], async_scheduling=cell["async_scheduling"])
    if cell["kind"] == "fp8":
        args["kv_cache_dtype"] = "fp8"
    return args


def run_cell(cell: dict, dirs: dict, refs: References) -> dict:
    import gc

    import torch

    from benchmarks.conformance_models import workload
    from pagedllm import LLM, SamplingParams

    path = dirs[cell["model"]]
    if cell["kind"] == "sweep":
        prompts, outs = cell["prompts"], cell["outs"]
    else:
        prompts, outs = workload(256)
    args = engine_args(cell, path, prompts, outs)
    os.environ["PAGEDLLM_PREFILL_GRAPHS"] = "full" if cell["graphs"] == "eager" else cell["graphs"]
    row = {k: v for k, v in cell.items() if k not in ("prompts", "outs")}
    row["engine_args"] = {k: v for k, v in args.items() if k not in ("device", "dtype")}
    t0 = time.perf_counter()

    def generate(a: dict) -> tuple[list[list[int]], dict, object]:
        llm = LLM(path, **a)
        params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=o) for o in outs]
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        m = llm.get_metrics()
        scales = list(llm.runner.kv_scales)  # type: ignore[attr-defined]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return [list(r.outputs[0].token_ids) for r in res], m, scales

    tokens, m, scales = generate(args)
    row["free_blocks_equal_total"] = m["num_free_kv_blocks"] == m["num_kv_blocks"]
    row["num_preemptions"] = m["num_preemptions"]
    row["prefix_cache_hit_tokens"] = m["prefix_cache_hit_tokens"]
    row["lengths_ok"] = [len(t) for t in tokens] == list(outs)
    ok = row["free_blocks_equal_total"] and row["lengths_ok"]
    if cell["kind"] == "fp8":
        worst = max(refs.fp8_worst(path, scales, 16, p, t) for p, t in zip(prompts, tokens, strict=True))
        row["reference"], row["worst_gap"], row["tie"] = "cpu-fp8", worst, FP8_TIE
        ok = ok and worst <= FP8_TIE
    elif cell["kind"] == "sweep":
        eager, _, _ = generate(dict(args, enforce_eager=True))
        row["equal_to_eager"] = eager == tokens
        row["reference"] = "eager (HF where they differ)"
        if eager != tokens:
            worst = max(refs.hf_worst(path, p, t) for p, t in zip(prompts, tokens + eager, strict=False))
            row["worst_gap"], row["tie"] = worst, TIE
            ok = ok and worst <= TIE
    else:
        worst = max(refs.hf_worst(path, p, t) for p, t in zip(prompts, tokens, strict=True))
        row["reference"], row["worst_gap"], row["tie"] = "hf-fp32-cpu", worst, TIE
        ok = ok and worst <= TIE
    row["status"] = "pass" if ok else "fail"
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def worker(chunk_file: str, result_file: str) -> None:
    import torch

    torch.set_num_threads(1)
    with open(chunk_file) as f:
        job = json.load(f)
    refs = References()
    with open(result_file, "a") as out:
        for cell in job["cells"]:
            try:
                row = run_cell(cell, job["dirs"], refs)
            except Exception as e:  # noqa: BLE001 (any error fails the cell and is recorded)
                row = {k: v for k, v in cell.items() if k not in ("prompts", "outs")}
                row.update(status="fail", error=f"{type(e).__name__}: {str(e)[:500]}")
                out.write(json.dumps(row) + "\n")
                out.flush()
                if "CUDA error" in str(e) or "AcceleratorError" in type(e).__name__:
                    sys.exit(3)  # the context is gone: the rest of the chunk is "not run"
                continue
            out.write(json.dumps(row) + "\n")
            out.flush()


# ---- orchestrator -----------------------------------------------------------------------------
def cell_id(c: dict) -> str:
    if c["kind"] == "sweep":
        return f"sweep/{c['index']}"
    parts = [c["kind"], c["model"], c["graphs"], c["pool"]]
    parts += [f"prefix={int(c['prefix_caching'])}", f"async={int(c['async_scheduling'])}"]
    return "/".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="conformance_out")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--sweep", type=int, default=50)
    ap.add_argument("--only", default=None, help="run the cells whose id matches this regex")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the harness (graph modes are moot there)")
    ap.add_argument("--models-dir", default=os.path.join(tempfile.gettempdir(), "pagedllm-conformance"))
    ap.add_argument("--worker", nargs=2, metavar=("CHUNK", "RESULT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker)
        return
    from benchmarks.conformance_models import MODELS, REFUSED, matrix_cells, sweep_cells, write_models
    from pagedllm.bench.common import environment

    t0 = time.perf_counter()
    os.makedirs(a.out, exist_ok=True)
    dirs = write_models(a.models_dir)
    cells = matrix_cells() + sweep_cells(a.sweep)
    for c in cells:
        c["id"] = cell_id(c)
    if a.only:
        cells = [c for c in cells if re.search(a.only, c["id"])]
    rows: dict[str, dict] = {}
    for c in cells:
        if c["model"] in REFUSED:
            rows[c["id"]] = dict(
                id=c["id"], kind=c["kind"], model=c["model"], status="refused", reason=REFUSED[c["model"]]
            )
    todo = [c for c in cells if c["id"] not in rows]
    todo.sort(key=lambda c: (c["model"], c["kind"]))  # a chunk shares its models' caches
    chunks = [todo[i : i + CHUNK] for i in range(0, len(todo), CHUNK)]
    work = tempfile.mkdtemp(prefix="conformance-")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        CONFORMANCE_DEVICE=a.device,
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    running: list[tuple[subprocess.Popen, list[dict], str]] = []
    logs: dict[int, str] = {}
    pending = list(enumerate(chunks))
    while pending or running:
        while pending and len(running) < a.workers:
            i, chunk = pending.pop(0)
            cf, rf = os.path.join(work, f"chunk{i}.json"), os.path.join(work, f"result{i}.jsonl")
            with open(cf, "w") as f:
                json.dump({"cells": chunk, "dirs": dirs}, f)
            log = open(os.path.join(work, f"log{i}.txt"), "w")  # noqa: SIM115 (closed with the process)
            p = subprocess.Popen([sys.executable, __file__, "--worker", cf, rf], stdout=log, stderr=log, env=env)
            logs[p.pid] = log.name
            running.append((p, chunk, rf))
        time.sleep(0.5)
        for item in [r for r in running if r[0].poll() is not None]:
            running.remove(item)
            p, chunk, rf = item
            done = {}
            if os.path.exists(rf):
                with open(rf) as f:
                    for line in f:
                        r = json.loads(line)
                        done[r["id"]] = r
            with open(logs[p.pid]) as f:
                tail = f.read()[-800:]
            for c in chunk:
                rows[c["id"]] = done.get(c["id"]) or dict(
                    id=c["id"], kind=c["kind"], model=c["model"], status="not run",
                    error=f"worker exited {p.returncode} before this cell: {tail}",
                )  # fmt: skip
            print(f"{len(rows)}/{len(cells)} cells, {time.perf_counter() - t0:.0f} s", flush=True)
    ordered = [rows[c["id"]] for c in cells]
    with open(os.path.join(a.out, "conformance.jsonl"), "w") as f:
        for r in ordered:
            f.write(json.dumps(r) + "\n")
    status = Counter(r["status"] for r in ordered)
    summary = dict(
        environment(),
        seconds=round(time.perf_counter() - t0, 1),
        cells=len(ordered),
        status=dict(status),
        failures=[r["id"] for r in ordered if r["status"] not in ("pass", "refused")],
        models=MODELS,
        refused=REFUSED,
        preempting_cells=sum(1 for r in ordered if r.get("num_preemptions", 0) > 0),
        sweep_equal_to_eager=sum(1 for r in ordered if r.get("equal_to_eager")),
        workers=a.workers,
    )
    with open(os.path.join(a.out, "conformance-summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: summary[k] for k in ("seconds", "cells", "status", "preempting_cells")}))
    for fid in summary["failures"][:30]:
        print("FAILED", fid, str(rows[fid].get("error", rows[fid]))[-300:])
    sys.exit(0 if not summary["failures"] else 1)


if __name__ == "__main__":
    main()
