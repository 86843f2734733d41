"""Tensor parallelism under torchrun: one process per rank, on one host or several.

    torchrun --nproc-per-node 2 examples/tp_torchrun.py --model DIR

Every rank runs this script. On rank 0 `LLM(...)` returns and the script generates and
prints; on the other ranks `LLM(...)` serves rank 0's steps and never returns: the process
exits (status 0) when rank 0 closes the LLM, here at the end of the `with` block.
"""

import argparse
import json

from pagedllm import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--prompt", action="append", help="a text prompt (repeatable)")
    p.add_argument("--prompt-ids", help="prompts as token ids, a JSON list of lists (overrides --prompt)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--enforce-eager", action="store_true")
    args = p.parse_args()

    from pagedllm import envs

    launched = envs.torchrun()  # (rank, world size, local rank) under torchrun
    world = launched[1] if launched is not None else 1
    with LLM(
        args.model,
        tensor_parallel_size=world,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
    ) as llm:
        # only rank 0 gets here
        prompts = (
            json.loads(args.prompt_ids)
            if args.prompt_ids
            else (args.prompt or ["The quick brown fox", "def fibonacci(n):"])
        )
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        for out in llm.generate(prompts, params, use_tqdm=False):
            print(
                json.dumps({"prompt": out.prompt, "token_ids": out.outputs[0].token_ids, "text": out.outputs[0].text}),
                flush=True,
            )
        m = llm.get_metrics()
        print(
            json.dumps(
                {"num_preemptions": m["num_preemptions"], "prefix_cache_hit_tokens": m["prefix_cache_hit_tokens"]}
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
