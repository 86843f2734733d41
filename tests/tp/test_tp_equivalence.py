"""TP=2 (two processes, gloo) gives the same greedy tokens as TP=1 and as HF transformers,
for every family, with prefix caching, chunked prefill and forced preemption."""

import multiprocessing

import pytest

from pagedllm import LLM
from tests.helpers import FAMILIES
from tests.tp.common import PREEMPTING, generate, hf_reference, workload


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_equals_tp1_and_hf(tiny_models, family):
    path = tiny_models[family]
    others = set(multiprocessing.active_children())  # e.g. a live test server's engine core
    prompts, max_tokens = workload()
    expected = hf_reference(path, prompts, max_tokens)
    tp1 = LLM(path, **PREEMPTING)  # before the TP group exists in this process
    assert generate(tp1, prompts, max_tokens) == expected
    del tp1

    with LLM(path, tensor_parallel_size=2, **PREEMPTING) as llm:
        workers = list(llm.runner.procs)
        assert len(workers) == 1 and workers[0].is_alive()
        assert llm.runner.supports_async is False and not llm.engine.async_scheduling  # auto: off under TP
        assert llm.runner.num_kv_blocks == llm.runner.driver.num_kv_blocks == 9
        assert generate(llm, prompts, max_tokens) == expected
        m = llm.get_metrics()
        assert m["num_preemptions"] > 0
        assert m["prefix_cache_hit_tokens"] > 0  # shared prompt prefixes, resumed victims
        assert m["num_free_kv_blocks"] == m["num_kv_blocks"] == 9
    # close() stopped the worker cleanly and left nothing behind
    assert workers[0].exitcode == 0
    assert set(multiprocessing.active_children()) <= others


def test_tp2_with_an_fp8_cache_equals_tp1(tiny_models):
    """Each rank measures the K/V ranges of its own heads; the scales are their max over the ranks,
    so both ranks store with the scales TP=1 measures and the tokens agree."""
    path = tiny_models["llama"]
    prompts, max_tokens = workload()
    prompts, max_tokens = prompts[:4], max_tokens[:4]
    tp1 = LLM(path, kv_cache_dtype="fp8", **PREEMPTING)
    expected, scales = generate(tp1, prompts, max_tokens), tp1.runner.kv_scales
    del tp1
    with LLM(path, tensor_parallel_size=2, kv_cache_dtype="fp8", **PREEMPTING) as llm:
        flat = [x for pair in llm.runner.driver.kv_scales for x in pair]
        assert flat == pytest.approx([x for pair in scales for x in pair], rel=1e-6)
        assert generate(llm, prompts, max_tokens) == expected
        assert llm.get_metrics()["kv_cache_dtype"] == "fp8_e4m3"
