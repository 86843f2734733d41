"""Logprobs and parallel sampling on the real model against HF transformers (float32, CPU),
read at the EngineCore level (EngineCoreOutput.new_logprobs / .prompt_logprobs).

Logprobs are the log-softmax of the raw logits: temperature, top-k and the min_tokens mask
change which token is drawn, never the numbers reported for it."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.helpers import FAMILIES
from tests.model.hf_reference import hf_model

TOL = 1e-4


def run_core(llm, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Queue every request at once and step the engine core to the end. Returns, per
    (request id, index): its token ids, its per-token logprobs (None if none came) and the
    prompt logprobs it was sent."""
    for rid, (ids, params) in requests.items():
        llm.engine.add_request(rid, ids, params)
    got: dict[tuple[str, int], dict] = {}
    core = llm.engine.core
    while core.has_unfinished_requests():
        for o in core.step():
            g = got.setdefault((o.request_id, o.index), dict(tokens=[], logprobs=[], prompt=None))
            g["tokens"] += o.new_token_ids
            if o.new_logprobs is None:
                g["logprobs"].append(None)
            else:
                assert len(o.new_logprobs) == len(o.new_token_ids)
                g["logprobs"] += o.new_logprobs
            if o.prompt_logprobs is not None:
                assert g["prompt"] is None, "prompt logprobs are sent once"
                g["prompt"] = o.prompt_logprobs
    return got


@torch.inference_mode()
def hf_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row p is HF's log-softmax (float32) of the distribution of token p + 1."""
    return hf_model(path)(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_entry(entry, lp: torch.Tensor, token: int, k: int) -> None:
    """One TokenLogprobs against HF's log-softmax row `lp` for the scored `token`, top `k`."""
    assert entry.token_ids[0] == token
    assert len(entry.token_ids) == len(entry.logprobs) == k + 1
    got = torch.tensor(entry.logprobs, dtype=torch.float32)
    ids = torch.tensor(entry.token_ids)
    torch.testing.assert_close(got, lp[ids], atol=TOL, rtol=0)  # every reported number is HF's
    top = lp.topk(k)
    torch.testing.assert_close(got[1:], top.values, atol=TOL, rtol=0)  # the top k, best first (ids up to ties)
    assert len(set(entry.token_ids[1:])) == k
    me = lp[token]
    assert int((lp > me + TOL).sum()) + 1 <= entry.rank <= int((lp >= me - TOL).sum())


def check_generated(path, prompt, out, k):
    lp = hf_logprobs(path, prompt + out["tokens"])
    assert len(out["logprobs"]) == len(out["tokens"])
    for j, (tok, entry) in enumerate(zip(out["tokens"], out["logprobs"], strict=True)):
        check_entry(entry, lp[len(prompt) - 1 + j], tok, k)
    return lp


def check_prompt(path, prompt, entries, k):
    lp = hf_logprobs(path, prompt)
    assert entries is not None and len(entries) == len(prompt) - 1
    for j, entry in enumerate(entries):  # entry j scores prompt token j + 1
        check_entry(entry, lp[j], prompt[j + 1], k)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 370) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ragged_batch_logprobs_match_hf(tiny_models, family, async_scheduling, monkeypatch):
    """One batch, chunked prefill (budget 16): greedy with logprobs, sampling with temperature and
    top-k, a request without any logprobs, and prompt logprobs over a prompt of three chunks,
    scored 7 rows per LM-head call."""
    monkeypatch.setattr("pagedllm.worker.logprobs.PROMPT_LOGPROBS_ROWS", 7)
    path = tiny_models[family]
    llm = LLM(path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    p = prompts(1, [11, 37, 5, 20])
    reqs = {
        "greedy": (p[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)),
        "prompt": (p[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=4)),
        "plain": (p[2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
        "hot": (p[3], SamplingParams(temperature=0.7, top_k=3, seed=7, max_tokens=6, ignore_eos=True, logprobs=2)),
    }
    got = run_core(llm, reqs)
    check_generated(path, p[0], got["greedy", 0], 5)
    assert all(e.rank == 1 for e in got["greedy", 0]["logprobs"])  # greedy draws the best (no ties here)
    lp = check_generated(path, p[3], got["hot", 0], 2)
    assert all(e.rank <= 3 for e in got["hot", 0]["logprobs"])  # top_k=3 draws among the best 3
    scaled = lp[len(p[3]) - 1 :].div(0.7).log_softmax(-1)  # what temperature would have reported
    assert (scaled.max(-1).values - lp[len(p[3]) - 1 :].max(-1).values).abs().max() > 1e-2
    check_prompt(path, p[1], got["prompt", 0]["prompt"], 4)
    assert got["prompt", 0]["logprobs"] == [None] * 3  # prompt logprobs only
    assert got["plain", 0]["logprobs"] == [None] * 5 and got["plain", 0]["prompt"] is None
    assert got["greedy", 0]["prompt"] is None
    m = llm.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]


def test_prompt_logprobs_the_same_chunked_or_not_and_with_a_cached_prefix(tiny_models):
    """Chunked prefill gives the prompt logprobs of one pass; a second request of the same prompt
    gets them too (it computes its prompt: no prefix-cache hit for a request that asks)."""
    path = tiny_models["qwen2"]
    (p,) = prompts(2, [45])
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    whole = run_core(LLM(path, num_kv_blocks=64, block_size=8), {"a": (p, params)})["a", 0]["prompt"]
    llm = LLM(path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=8)
    chunked = run_core(llm, {"a": (p, params)})["a", 0]["prompt"]
    check_prompt(path, p, whole, 0)
    assert [e.token_ids for e in chunked] == [e.token_ids for e in whole]
    assert [e.rank for e in chunked] == [e.rank for e in whole]
    torch.testing.assert_close(
        torch.tensor([e.logprobs for e in chunked]), torch.tensor([e.logprobs for e in whole]), atol=TOL, rtol=0
    )
    again = run_core(llm, {"b": (p, params)})["b", 0]["prompt"]
    assert [e.token_ids for e in again] == [e.token_ids for e in whole]


def test_min_tokens_mask_does_not_change_the_logprobs(tiny_models):
    """The token HF ranks first is banned (a stop token id under min_tokens): greedy draws the
    second best, and its reported logprobs are still the raw ones, with rank 2."""
    path = tiny_models["llama"]
    (p,) = prompts(3, [9])
    lp = hf_logprobs(path, p)[-1]
    best = int(lp.argmax())
    params = SamplingParams(temperature=0, max_tokens=1, min_tokens=1, stop_token_ids=[best], logprobs=3)
    out = run_core(LLM(path, num_kv_blocks=32, block_size=8), {"a": (p, params)})["a", 0]
    assert out["tokens"] == [int(lp.topk(2).indices[1])]
    check_generated(path, p, out, 3)
    (entry,) = out["logprobs"]
    assert entry.rank == 2 and entry.token_ids[1] == best


def sampled_alone(path, prompt, params, **kw):
    llm = LLM(path, num_kv_blocks=64, **kw)
    return run_core(llm, {"r": (prompt, params)})


@pytest.mark.parametrize("prompt_len", [13, 16])
def test_parallel_sampling_children_equal_seeded_requests_alone(tiny_models, prompt_len):
    """n=3 with seed s: child i draws what a request with seed s + i draws alone, in any batch
    company; with a prompt that ends inside a block the children copy it on their first write."""
    path = tiny_models["qwen3"]
    (p, other) = prompts(4, [prompt_len, 10])
    hot = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    alone = [sampled_alone(path, p, SamplingParams(seed=41 + i, **hot), block_size=8)["r", 0] for i in range(3)]
    llm = LLM(path, num_kv_blocks=64, block_size=8)
    got = run_core(
        llm,
        {
            "n3": (p, SamplingParams(n=3, seed=41, logprobs=1, **hot)),
            "company": (other, SamplingParams(seed=5, **hot)),
        },
    )
    assert len({tuple(a["tokens"]) for a in alone}) == 3  # different seeds draw differently
    for i in range(3):
        assert got["n3", i]["tokens"] == alone[i]["tokens"]
        check_generated(path, p, got["n3", i], 1)
    m = llm.get_metrics()
    assert m["num_forked_sequences"] == 2
    assert (m["num_copy_on_write_blocks"] > 0) == (prompt_len % 8 != 0)
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]


@pytest.mark.parametrize("prompt_len", [13, 16])
def test_greedy_n2_equals_greedy_n1(tiny_models, prompt_len):
    path = tiny_models["qwen2"]
    (p,) = prompts(5, [prompt_len])
    greedy = dict(temperature=0, max_tokens=10, ignore_eos=True)
    one = sampled_alone(path, p, SamplingParams(**greedy), block_size=8)["r", 0]["tokens"]
    llm = LLM(path, num_kv_blocks=64, block_size=8)
    got = run_core(llm, {"r": (p, SamplingParams(n=2, logprobs=0, **greedy))})
    assert got["r", 0]["tokens"] == got["r", 1]["tokens"] == one
    for i in range(2):  # logprobs=0: the sampled token's own logprob and rank only
        check_generated(path, p, got["r", i], 0)
    assert (llm.get_metrics()["num_copy_on_write_blocks"] > 0) == (prompt_len % 8 != 0)
