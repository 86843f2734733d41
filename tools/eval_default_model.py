#!/usr/bin/env python3
"""Evaluate pagedllm's default model (or any HF causal LM folder) with plain transformers.

* ``import`` test: ``--n`` seeded samples (temperature 0.7, top_p 1.0,
  ``--import-tokens`` new tokens) completing ``"import "``.  A sample counts
  when the identifier it starts with (up to the first non-identifier
  character; the top-level name before any dot) is a module that
  ``importlib.util.find_spec`` finds in *this* interpreter.
* ``def`` test: ``--n`` seeded samples (``--def-tokens`` new tokens)
  completing ``"def "``.  The completion is cut at its first blank line
  (``"\\n\\n"``), if any, and ``"def " + cut`` counts when ``ast.parse``
  accepts it.  Nothing else is trimmed: a completion that runs out of tokens
  in the middle of a function with no blank line usually fails.
* Greedy completions of a few prompts, printed and stored.

Sample ``i`` is drawn after ``torch.manual_seed(seed + i)``.  Results are
printed and written as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import platform
import re
import sys
import time
import warnings

import torch

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
GREEDY_PROMPTS = [
    "def fibonacci(",
    "import ",
    "class Stack:\n",
    "def is_prime(n):\n",
    "for i in range(",
    "    def __init__(self",
]


def module_of(completion: str) -> str | None:
    m = IDENT.match(completion)
    return m.group(0) if m else None


def module_exists(name: str | None) -> bool:
    if not name:
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def def_parses(completion: str) -> tuple[bool, str]:
    cut = completion.split("\n\n", 1)[0]
    src = "def " + cut
    try:
        ast.parse(src)
        return True, src
    except SyntaxError:
        return False, src


def sample(model, tok, prompt: str, max_new_tokens: int, seed: int | None, device, temperature=0.7, top_p=1.0) -> str:
    enc = tok(prompt, return_tensors="pt").to(device)
    kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if seed is None:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        torch.manual_seed(seed)
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    with torch.no_grad():
        out = model.generate(**enc, **kwargs)
    return tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--import-tokens", type=int, default=24)
    p.add_argument("--def-tokens", type=int, default=64)
    p.add_argument("--greedy-tokens", type=int, default=64)
    p.add_argument("--device", default="", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--json", default="", help="write results here")
    p.add_argument("--quiet", action="store_true", help="do not print every sample")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    t0 = time.time()

    imports = []
    for i in range(args.n):
        c = sample(model, tok, "import ", args.import_tokens, args.seed + i, device, args.temperature, args.top_p)
        name = module_of(c)
        ok = module_exists(name)
        imports.append({"seed": args.seed + i, "completion": c, "module": name, "found": ok})
        if not args.quiet:
            print(f"[import {i:2d}] {'OK ' if ok else 'BAD'} {name!r:24} {('import ' + c)[:70]!r}")
    n_import = sum(r["found"] for r in imports)

    defs = []
    for i in range(args.n):
        c = sample(model, tok, "def ", args.def_tokens, args.seed + i, device, args.temperature, args.top_p)
        ok, src = def_parses(c)
        defs.append(
            {"seed": args.seed + i, "completion": c, "parsed_source": src, "parses": ok, "had_blank_line": "\n\n" in c}
        )
        if not args.quiet:
            print(f"[def {i:2d}] {'OK ' if ok else 'BAD'} {src[:100]!r}")
    n_def = sum(r["parses"] for r in defs)

    greedy = []
    for prompt in GREEDY_PROMPTS:
        c = sample(model, tok, prompt, args.greedy_tokens, None, device)
        greedy.append({"prompt": prompt, "completion": c})
        print(f"--- greedy: {prompt!r}\n{prompt}{c}\n")

    res = {
        "model": args.model,
        "n": args.n,
        "seed": args.seed,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "import_tokens": args.import_tokens,
        "def_tokens": args.def_tokens,
        "import_found": n_import,
        "def_parses": n_def,
        "def_with_blank_line": sum(r["had_blank_line"] for r in defs),
        "imports": imports,
        "defs": defs,
        "greedy": greedy,
        "device": str(device),
        "dtype": "float32",
        "python_version_for_find_spec": platform.python_version(),
        "torch_version": torch.__version__,
        "seconds": time.time() - t0,
    }
    import transformers

    res["transformers_version"] = transformers.__version__
    print(f"import: {n_import}/{args.n} name a module find_spec finds (Python {platform.python_version()})")
    print(
        f"def:    {n_def}/{args.n} parse with ast.parse after cutting at the first blank line "
        f"({res['def_with_blank_line']} had a blank line)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
