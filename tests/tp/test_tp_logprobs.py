"""TP=2 (two processes, gloo) returns the logprobs and prompt logprobs of TP=1, and parallel
sampling with copy-on-write on every rank's KV shard draws what TP=1 draws."""

import torch

from pagedllm import LLM, SamplingParams
from tests.model.test_logprobs import check_prompt, prompts, run_core

CONFIG = dict(block_size=8, num_kv_blocks=32, max_num_batched_tokens=16)


def requests():
    p = prompts(6, [21, 13, 9])
    return {
        "lp": (p[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)),
        "n2": (p[1], SamplingParams(n=2, seed=3, temperature=1.0, max_tokens=6, ignore_eos=True, logprobs=1)),
        "plain": (p[2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
    }


def flat(entries):
    return [e.token_ids for e in entries], [e.rank for e in entries], torch.tensor([e.logprobs for e in entries])


def test_tp2_logprobs_equal_tp1(tiny_models):
    path = tiny_models["qwen3"]
    tp1 = run_core(LLM(path, **CONFIG), requests())
    with LLM(path, tensor_parallel_size=2, **CONFIG) as llm:
        tp2 = run_core(llm, requests())
        assert llm.get_metrics()["num_copy_on_write_blocks"] > 0  # 13 tokens: the last block is shared
    assert tp1.keys() == tp2.keys()
    for key, a in tp1.items():
        b = tp2[key]
        assert a["tokens"] == b["tokens"], key
        if a["logprobs"][0] is None:
            assert b["logprobs"] == a["logprobs"]
            continue
        ids_a, ranks_a, lps_a = flat(a["logprobs"])
        ids_b, ranks_b, lps_b = flat(b["logprobs"])
        assert ids_a == ids_b and ranks_a == ranks_b
        torch.testing.assert_close(lps_b, lps_a, atol=1e-4, rtol=0)
    check_prompt(path, requests()["lp"][0], tp2["lp", 0]["prompt"], 2)
    assert tp2["n2", 0]["tokens"] != tp2["n2", 1]["tokens"]
