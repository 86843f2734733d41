"""Prefix-cache hardening seen through LLM.generate (a tiny random model on CPU): cache_salt
decides who shares KV, sha256 hashing hits like xxhash, and neither changes the tokens."""

import pytest

from pagedllm import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
SHARED = list(range(10, 40))  # 30 tokens: 3 full 8-token blocks, then the tails below


def ask(llm, tail, salt=None):
    params = SamplingParams(max_tokens=3, cache_salt=salt, **GREEDY)
    out = llm.generate([SHARED + tail], params, use_tqdm=False)[0]
    return out.num_cached_tokens, out.outputs[0].token_ids


@pytest.mark.parametrize("algo", ["xxhash", "sha256"])
def test_cache_salt_through_generate(tiny_models, algo):
    llm = LLM(tiny_models["qwen3"], num_kv_blocks=64, block_size=8, prefix_caching_hash_algo=algo)
    assert ask(llm, [1], "tenant-a")[0] == 0
    cached_b, tokens_b = ask(llm, [2], "tenant-b")
    cached_none, tokens_none = ask(llm, [2])
    cached_a, tokens_a = ask(llm, [2], "tenant-a")
    assert (cached_b, cached_none, cached_a) == (0, 0, 24)  # only the same tenant hits its prefix
    assert ask(llm, [3])[0] == 24  # requests without a salt share among themselves
    assert tokens_a == tokens_b == tokens_none  # the salt never changes results
    m = llm.get_metrics()
    assert (m["prefix_cache_requests"], m["prefix_cache_hit_tokens"]) == (5, 48)
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
    llm.engine.kv.pool.check_invariants()
