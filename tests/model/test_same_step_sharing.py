"""Same-step prefix sharing on a real model: requests that arrive together read the shared
prefix's KV that the first of them writes in the same forward pass (every layer stores K/V
before it attends), so the hits are exact: greedy tokens equal those with prefix caching off."""

import pytest

from pagedllm import LLM, SamplingParams

PREFIX = [(7 * i + 3) % 300 + 1 for i in range(43)]  # 5 full blocks of 8, and 3 tokens more
PROMPTS = [PREFIX + [11 + i, 40 + 2 * i] for i in range(6)] + [PREFIX[:20]]


def run(path, **kw):
    llm = LLM(path, num_kv_blocks=96, block_size=8, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.get_metrics(), [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize(
    "kw",
    [
        {},  # all prompts prefilled in one step
        {"max_num_batched_tokens": 64},  # chunked: the first prompt spans two steps
        {"async_scheduling": True},
    ],
    ids=["one-step", "chunked", "async"],
)
def test_requests_of_one_step_share_the_prefix_exactly(tiny_models, family, kw):
    off, _, _ = run(tiny_models[family], enable_prefix_caching=False, **kw)
    on, metrics, cached = run(tiny_models[family], **kw)
    assert on == off
    # a fresh engine: every hit was written by a request of the same (or the previous) step
    assert cached[0] == 0
    if "max_num_batched_tokens" not in kw:
        assert cached[1:6] == [40] * 5 and cached[6] == 16
    assert metrics["prefix_cache_hit_tokens"] == sum(cached) > 0
