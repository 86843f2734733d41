"""TP=2 (two processes, gloo) returns the logprobs and prompt logprobs of TP=1, and parallel
sampling with copy-on-write on every rank's KV shard draws what TP=1 draws; the throughput
bench's step timer times rank 0's steps under TP. One TP=2 engine for the module (a worker's
start is the slow part)."""

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench import throughput
from tests.model.test_logprobs import check_prompt, prompts, run_core
from tests.test_bench_throughput import FakeEvent

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


@pytest.fixture(scope="module")
def tp1(tiny_models):
    """TP=1's answers, computed before the TP group exists in this process (it cannot be built after)."""
    return run_core(LLM(tiny_models["qwen3"], **CONFIG), requests())


@pytest.fixture(scope="module")
def tp2_llm(tiny_models, tp1):
    with LLM(tiny_models["qwen3"], tensor_parallel_size=2, **CONFIG) as llm:
        yield llm


def test_tp2_logprobs_equal_tp1(tiny_models, tp1, tp2_llm):
    path = tiny_models["qwen3"]
    tp2 = run_core(tp2_llm, requests())
    assert tp2_llm.get_metrics()["num_copy_on_write_blocks"] > 0  # 13 tokens: the last block is shared
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


def test_step_timer_times_rank_0_under_tensor_parallelism(tp2_llm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    # the timer wraps these two; the module's engine gets them back afterwards
    monkeypatch.setattr(tp2_llm.engine, "step", tp2_llm.engine.step)
    monkeypatch.setattr(tp2_llm.runner.driver, "launch", tp2_llm.runner.driver.launch)
    timer = throughput.StepTimer(tp2_llm)
    tp2_llm.generate([[1, 2, 3]] * 3, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert timer.summary()["time_by_step_kind"]["decode_batch_1_16"]["steps"] == 3
