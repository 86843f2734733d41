"""The API process's CPU time to turn one request body into a checked engine request: the
`parse_tokenize` stage of `benchmarks/request_timeline.py`, without a server or an engine.

Each body is prepared as the server prepares it (`OpenAIServing._prepare_completion` /
`_prepare_chat`: JSON, field checks, tokenizing, the input processor's checks), over the bundled
model's tokenizer and an engine stand-in that only answers what the serving layer reads. Three
bodies of the serving benchmark's size: 512 token ids (this project's client), the text of 512
random tokens (vLLM's client sends text), and that text as one chat message; these repeat over
rounds, so the tokenizer's BPE cache is warm for them, and `prepare_text_fresh_us` times text that
is new to every call (as in a server). Also timed: the
request's log line (`--enable-log-requests`, on by default) and one `asyncio.to_thread` hop.
Runs against whatever `pagedllm` is importable, so an older tree can be measured with the same
script (PYTHONPATH=OLD python benchmarks/request_prep.py).

    python benchmarks/request_prep.py --label after --out benchmarks/results/api_cpu/request-prep-cpu.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import time
from typing import Any


class EngineStandIn:
    """What OpenAIServing reads of the engine (serving.EngineClient), without a core process."""

    timeline = None
    is_dead = False

    def __init__(self, model_dir: str) -> None:
        from pagedllm.engine.input_processor import InputProcessor
        from pagedllm.entrypoints.model_dir import generation_defaults, load_hf_config, load_tokenizer

        cfg = load_hf_config(model_dir)
        self.model_path = model_dir
        self.tokenizer = load_tokenizer(model_dir)
        self.generation_defaults = generation_defaults(model_dir, "auto")
        self.max_model_len, self.block_size, self.num_kv_blocks = cfg.max_position_embeddings, 16, 4096
        self.input_processor = InputProcessor(
            self.tokenizer, cfg.vocab_size, self.max_model_len, self.block_size, self.num_kv_blocks, max_num_seqs=256
        )

    def add_request(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("only preparation is timed")


def fresh_per_call_us(fn: Any, batches: list[list[Any]]) -> float:
    """Median over batches of the mean time of fn(item) in a batch, in microseconds. Batches of
    distinct items time every item seen once, as a server sees random prompts (the tokenizer's BPE
    cache makes a repeated body cheaper)."""
    means = []
    for items in batches:
        start = time.perf_counter()
        for item in items:
            fn(item)
        means.append((time.perf_counter() - start) / len(items) * 1e6)
    return round(statistics.median(means), 1)


def per_call_us(fn: Any, items: list[Any], rounds: int) -> float:
    """Median over rounds of the mean time of fn(item) across items (the same items each round,
    after a warm-up), in microseconds."""
    for item in items[:10]:
        fn(item)
    return fresh_per_call_us(fn, [items] * rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-bodies", type=int, default=200)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None, help="append the result as one JSON line")
    args = p.parse_args()

    import pagedllm
    from pagedllm.bench.common import append_json_line, environment
    from pagedllm.entrypoints.openai.serving import OpenAIServing

    engine = EngineStandIn(str(pagedllm.default_model_path()))
    serving = OpenAIServing(engine, "m")  # type: ignore[arg-type]  (the stand-in answers what preparation reads)
    rng = random.Random(0)
    ids = [[rng.randrange(100, 8000) for _ in range(args.input_len)] for _ in range(args.num_bodies)]
    texts = [engine.tokenizer.decode(x) for x in ids]
    common = {"model": "m", "max_tokens": 128, "stream": True, "ignore_eos": True, "temperature": 0}
    bodies = {
        "token_ids": [json.dumps({**common, "prompt": x}).encode() for x in ids],
        "text": [json.dumps({**common, "prompt": t}).encode() for t in texts],
        "chat": [json.dumps({**common, "messages": [{"role": "user", "content": t}]}).encode() for t in texts],
    }
    if not getattr(engine.tokenizer, "chat_template", None):
        engine.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    results: dict[str, Any] = {}
    for kind, bs in bodies.items():
        prepare = serving._prepare_chat if kind == "chat" else serving._prepare_completion
        results[f"prepare_{kind}_us"] = per_call_us(prepare, bs, args.rounds)
    # text never seen before (the --text-prompts timeline's case): the benchmark's own distribution
    # of ids, all of the bundled vocabulary, rounds x bodies distinct prompts
    fresh_ids = [[rng.randrange(0, 8192) for _ in range(args.input_len)] for _ in range(args.rounds * args.num_bodies)]
    fresh = [json.dumps({**common, "prompt": engine.tokenizer.decode(x)}).encode() for x in fresh_ids]
    n = args.num_bodies
    batches = [fresh[i * n : (i + 1) * n] for i in range(args.rounds)]
    results["prepare_text_fresh_us"] = fresh_per_call_us(serving._prepare_completion, batches)

    # the per-request log line, as AsyncLLM writes it, to a handler that formats and discards
    requests = [serving._prepare_completion(b)[1][0] for b in bodies["token_ids"]]
    log = logging.getLogger("pagedllm.bench.request_prep")
    log.propagate = False
    handler = logging.StreamHandler(open("/dev/null", "w"))  # noqa: SIM115  (closed with the process)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)

    def log_line(r: Any) -> None:
        log.info("Received request %s: prompt tokens: %d, params: %s", r.request_id, len(r.prompt_token_ids), r.params)

    results["log_line_us"] = per_call_us(log_line, requests, args.rounds)

    async def hops() -> float:
        for _ in range(20):
            await asyncio.to_thread(int)
        start = time.perf_counter()
        for _ in range(args.num_bodies):
            await asyncio.to_thread(int)
        return (time.perf_counter() - start) / args.num_bodies * 1e6

    results["to_thread_hop_us"] = round(statistics.median(asyncio.run(hops()) for _ in range(args.rounds)), 1)
    out = {"benchmark": "request_prep", "input_len": args.input_len, "label": args.label, "results": results}
    out.update(environment())
    print(json.dumps(out))
    append_json_line(out, args.out)


if __name__ == "__main__":
    main()
