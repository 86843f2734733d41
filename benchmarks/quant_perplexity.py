"""Perplexity of the bundled model quantized by tools/quantize_checkpoint.py in each checkpoint format,
against the unquantized model, on its held-out files (train_log.json's `val_files`, read from a
Python standard library: the model was trained on CPython 3.12's; another version's files of the same
names are a stand-in, reported as such).

Each file is tokenized and cut into windows of --window tokens; every token of a window but its first
is scored (prompt logprobs, teacher-forced), float32 on the device chosen by LLM. Formats: block-wise
FP8 (64x64 blocks: the model's 320 / 960 / 384 / 128 dimensions take no 128 block), FP8 per channel
(compressed-tensors, dynamic per-token activations), FP8 per tensor (quant_method fp8), AWQ and
symmetric GPTQ (groups of 64; the tool rounds to nearest, so asymmetric GPTQ would be AWQ's weights). JSON rows on stdout and in $OUT/quant-perplexity.json (OUT default: .).

    python benchmarks/quant_perplexity.py [--stdlib DIR] [--window 1024]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import sysconfig
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from pagedllm import LLM, SamplingParams, default_model_path  # noqa: E402

FORMATS = {  # name -> quantize_dir arguments (None: the unquantized model)
    "unquantized": None,
    "fp8-block-64": dict(fmt="fp8-block", block=(64, 64)),
    "fp8-channel": dict(fmt="compressed-tensors", weights="channel"),
    "fp8-tensor": dict(fmt="fp8", weights="tensor"),
    "awq-g64": dict(fmt="awq", group_size=64),
    "gptq-g64-sym": dict(fmt="gptq", group_size=64, sym=True),  # asymmetric GPTQ without desc_act = AWQ's weights
}


def quantize_dir():
    spec = importlib.util.spec_from_file_location(
        "quantize_checkpoint", os.path.join(ROOT, "tools/quantize_checkpoint.py")
    )
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.quantize_dir


def windows(llm: LLM, stdlib: str, files: list[str], size: int) -> tuple[list[list[int]], list[str]]:
    """Token windows of the held-out files found under stdlib, and the files missing there."""
    tok = llm.get_tokenizer()
    out, missing = [], []
    for name in files:
        path = os.path.join(stdlib, name)
        if not os.path.isfile(path):
            missing.append(name)
            continue
        with open(path, encoding="utf-8") as f:
            ids = tok.encode(f.read(), add_special_tokens=False)
        out += [ids[i : i + size] for i in range(0, len(ids), size) if len(ids[i : i + size]) > 1]
    return out, missing


def nll(llm: LLM, chunks: list[list[int]]) -> tuple[float, int]:
    """(sum of -log p over every scored token, their count)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    total, count = 0.0, 0
    for chunk, out in zip(chunks, outs, strict=True):
        for tid, lp in zip(chunk[1:], out.prompt_logprobs[1:], strict=True):
            total -= lp[tid].logprob
            count += 1
    return total, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--window", type=int, default=1024)
    args = ap.parse_args()
    src = default_model_path()
    with open(os.path.join(src, "train_log.json")) as f:
        log = json.load(f)
    quantize = quantize_dir()
    rows: list[dict] = []
    chunks: list[list[int]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, kwargs in FORMATS.items():
            path = src
            if kwargs is not None:
                path = os.path.join(tmp, name)
                kwargs = dict(kwargs)
                quantize(src, path, kwargs.pop("fmt"), **kwargs)
            llm = LLM(path, dtype="float32", max_model_len=args.window + 8, enable_prefix_caching=False)
            if not chunks:
                chunks, missing = windows(llm, args.stdlib, log["val_files"], args.window)
            total, count = nll(llm, chunks)
            llm.close()
            row = dict(format=name, perplexity=math.exp(total / count), tokens=count)
            if rows:
                row["vs_unquantized"] = row["perplexity"] / rows[0]["perplexity"] - 1
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = dict(
        rows=rows,
        stdlib=args.stdlib,
        python=platform.python_version(),
        torch=torch.__version__,
        cpu=platform.processor() or platform.machine(),
        held_out_files=len(log["val_files"]) - len(missing),
        missing_files=missing,
        note="the model was trained on CPython 3.12's stdlib; these are this Python's files of the same names",
        commit=os.environ.get("PAGEDLLM_COMMIT"),
    )
    with open(os.path.join(os.environ.get("OUT", "."), "quant-perplexity.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
