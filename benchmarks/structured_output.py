#!/usr/bin/env python3
"""Structured output costs on CPU with the bundled model (vocabulary 8,192).

(a) llguidance (the engine's library) vs xgrammar (installed for comparison only) on the JSON
    schema of tests/engine/test_structured_output.py, compact JSON: the tokenizer's one-time
    build, the schema's compile time (median of --repeat fresh compilations, caches off), and
    the mask time per token (median over the tokens of one valid document, walked token by token:
    fill the next-token mask, then consume the token).
(b) One decode step's mask for a batch of --batch constrained sequences, each at its own place in
    the document: serial fill (one matcher after the other) vs llguidance's parallel fill
    (LLExecutor threads), the time of the engine's grammar_bitmask for that batch included.
(c) LLM throughput on the bundled model: --requests requests of exactly --max-tokens each, every
    one carrying a JSON schema it cannot complete within max_tokens (one string of minLength
    > 4 x max_tokens: the same tokens to generate as the free run, plus a mask per step) vs none
    (ignore_eos), output tokens per second of LLM.generate (sync scheduling, the CPU default).

    python benchmarks/structured_output.py --out /tmp/structured.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def schema() -> dict[str, Any]:
    from tests.engine.test_structured_output import SCHEMA

    return SCHEMA


DOC = {"name": "Rex", "kind": "dog", "tags": ["a", "bc"], "pos": {"x": 42}}  # a document the schema accepts


def median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 4)


def bench_llguidance(tok: Any, vocab: int, doc_ids: list[int], repeat: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln

    from pagedllm.engine.grammar import GrammarKey, grammar_spec

    t = time.perf_counter()
    ll = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    tok_s = time.perf_counter() - t
    spec = grammar_spec(GrammarKey("json", json.dumps(schema()), True))
    compiles = []
    for _ in range(repeat):
        t = time.perf_counter()
        m = llguidance.LLMatcher(ll, spec, log_level=0)
        compiles.append(time.perf_counter() - t)
    bits = lln.allocate_token_bitmask(1, vocab)
    masks = []
    for token in doc_ids:
        t = time.perf_counter()
        lln.fill_next_token_bitmask(m, bits, 0)
        masks.append(time.perf_counter() - t)
        assert m.consume_token(token), m.get_error()
    return (
        {
            "tokenizer_build_ms": round(tok_s * 1e3, 2),
            "compile_ms": median_ms(compiles),
            "mask_ms_per_token": median_ms(masks),
        },
        ll,
        spec,
    )


def bench_xgrammar(tok: Any, vocab: int, doc_ids: list[int], repeat: int) -> dict[str, Any]:
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    tok_s = time.perf_counter() - t
    text = json.dumps(schema())
    compiles = []
    for _ in range(repeat):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
        compiles.append(time.perf_counter() - t)
    matcher = xgr.GrammarMatcher(compiled)
    bits = xgr.allocate_token_bitmask(1, vocab)
    masks = []
    for token in doc_ids:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(bits)
        masks.append(time.perf_counter() - t)
        assert matcher.accept_token(token)
    return {
        "tokenizer_build_ms": round(tok_s * 1e3, 2),
        "compile_ms": median_ms(compiles),
        "mask_ms_per_token": median_ms(masks),
    }


class _Seq:
    """What grammar_bitmask reads of a sequence."""

    def __init__(self, grammar: Any, params: Any):
        self.grammar, self.sampling_params, self.num_pending = grammar, params, 0


def bench_batch(ll: Any, spec: str, vocab: int, doc_ids: list[int], batch: int, repeat: int) -> dict[str, Any]:
    import llguidance
    import llguidance.numpy as lln

    from pagedllm.engine.sampling_params import SamplingParams
    from pagedllm.engine.structured_output import SequenceGrammar, StructuredOutputManager, grammar_bitmask

    manager = StructuredOutputManager(lambda: ll, frozenset({0}))
    manager.tokenizer()
    template = llguidance.LLMatcher(ll, spec, log_level=0)
    seqs = []
    for i in range(batch):  # each at its own place in the document
        m = template.deep_copy()
        for token in doc_ids[: i % (len(doc_ids) - 1)]:
            m.consume_token(token)
        seqs.append(_Seq(SequenceGrammar(manager, None, m), SamplingParams()))
    matchers = [s.grammar.matcher for s in seqs]
    bits = lln.allocate_token_bitmask(batch, vocab)
    serial, par, engine = [], [], []
    for _ in range(repeat):
        t = time.perf_counter()
        for k, m in enumerate(matchers):
            lln.fill_next_token_bitmask(m, bits, k)
        serial.append(time.perf_counter() - t)
        t = time.perf_counter()
        lln.fill_next_token_bitmask_par(manager.executor, [(m, k) for k, m in enumerate(matchers)], bits)
        par.append(time.perf_counter() - t)
        t = time.perf_counter()
        grammar_bitmask(seqs, vocab)  # type: ignore[arg-type]
        engine.append(time.perf_counter() - t)
    return {
        "batch": batch,
        "cpus": os.cpu_count(),
        "serial_ms": median_ms(serial),
        "parallel_ms": median_ms(par),
        "grammar_bitmask_ms": median_ms(engine),
    }


def bench_llm(requests: int, max_tokens: int) -> dict[str, Any]:
    from pagedllm import LLM, SamplingParams, default_model_path
    from pagedllm.engine.sampling_params import StructuredOutputsParams

    rows: dict[str, Any] = {"requests": requests, "max_tokens": max_tokens}
    with LLM(default_model_path(), device="cpu", num_kv_blocks=4096) as llm:
        prompts = ["def main():"] * requests
        llm.generate(prompts[:4], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        long = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4 * max_tokens + 1}}}
        long["required"] = ["text"]
        for name, so in (("none", None), ("json_schema", StructuredOutputsParams(json=long))):
            params = [
                SamplingParams(
                    temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=so is None, structured_outputs=so
                )
                for i in range(requests)
            ]
            if so is not None:  # compile (and build the tokenizer) outside the timed run
                llm.generate(prompts[:1], params[:1], use_tqdm=False)
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            rows[name] = {"output_tokens": n, "wall_s": round(wall, 3), "tok_s": round(n / wall, 1)}
    rows["tok_s_ratio"] = round(rows["json_schema"]["tok_s"] / rows["none"]["tok_s"], 3)
    return rows


def has_xgrammar() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=20, help="compilations / batch fills timed (default: 20)")
    p.add_argument("--batch", type=int, default=256, help="constrained sequences in the batch of (b) (default: 256)")
    p.add_argument("--requests", type=int, default=32, help="requests of (c) (default: 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of (c) (default: 64)")
    p.add_argument("--out", help="write the results as JSON to this file")
    args = p.parse_args()

    from pagedllm import default_model_path
    from pagedllm.entrypoints.model_dir import load_tokenizer

    tok = load_tokenizer(default_model_path())
    vocab = 8192
    doc_ids = list(tok.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)) + [0]  # + EOS
    guidance, ll, spec = bench_llguidance(tok, vocab, doc_ids, args.repeat)
    result = {
        "model": "pagedllm/default_model",
        "doc_tokens": len(doc_ids),
        "llguidance": guidance,
        "xgrammar": bench_xgrammar(tok, vocab, doc_ids, args.repeat) if has_xgrammar() else "not installed",
        "batch_mask": bench_batch(ll, spec, vocab, doc_ids, args.batch, args.repeat),
        "llm": bench_llm(args.requests, args.max_tokens),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
