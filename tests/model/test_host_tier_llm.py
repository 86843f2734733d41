"""The host tier through LLM on CPU (two host buffers, the same logic as pinned memory on a GPU):
greedy outputs with the tier on equal those with it off, for every family (the windowed ones
too), fp8 KV and swap preemption, with GPU pools small enough that the second turns of the
conversations find their prefixes only in the host tier (the metrics show host hits). Bad sizes
fail at start-up naming kv_offloading_size; the buffer itself round-trips blocks exactly."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.errors import InvalidRequestError
from pagedllm.worker.host_kv_cache import HostKVCache, _runs
from tests.model.families import KINDS, family_checkpoints
from tests.model.hf_reference import GREEDY

GiB = 1 << 30


@pytest.fixture(scope="module")
def family_models(tiny_models, tmp_path_factory):
    return family_checkpoints(tiny_models["qwen3"], tmp_path_factory)


def conversations(n: int = 4, system: int = 40, turn: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    """First and second turns of n conversations behind n system prompts (token ids)."""
    g = torch.Generator().manual_seed(5)
    first = [torch.randint(1, 370, (system + turn,), generator=g).tolist() for _ in range(n)]
    second = [p + torch.randint(1, 370, (2 * turn,), generator=g).tolist() for p in first]
    return first, second


def chat(llm: LLM, max_tokens: int = 4) -> list[list[int]]:
    """Both turns, one conversation after another (each turn's prompt goes in alone)."""
    first, second = conversations()
    out = []
    for prompt in first + second:
        (r,) = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)
        out.append(list(r.outputs[0].token_ids))
    return out


BASE = dict(block_size=8, num_kv_blocks=16, max_model_len=256, max_num_batched_tokens=64)


def host_gib(llm: LLM, blocks: int) -> float:
    return blocks * llm.runner.block_bytes / GiB


def run_both(path: str, **kw) -> tuple[list[list[int]], list[list[int]], dict]:
    with LLM(path, **{**BASE, **kw}) as off:
        want = chat(off)
        size = host_gib(off, 64)
    with LLM(path, **{**BASE, **kw}, kv_offloading_size=size) as on:
        got = chat(on)
        m = on.get_metrics()
    return want, got, m


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_tier_on_equals_tier_off_and_hits_come_from_host(tiny_models, family):
    want, got, m = run_both(tiny_models[family])
    assert got == want
    assert m["prefix_cache_host_hit_tokens"] > 0 and m["num_loaded_blocks"] > 0
    assert m["kv_load_bytes"] == m["num_loaded_blocks"] * (m["kv_offload_bytes"] // m["num_offloaded_blocks"])
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]


@pytest.mark.parametrize("kind", KINDS)
def test_windowed_families(family_models, kind):
    want, got, m = run_both(family_models[kind], num_kv_blocks=24)
    assert got == want
    assert m["num_offloaded_blocks"] > 0


def test_fp8_kv_and_swap_preemption(tiny_models):
    path = tiny_models["qwen3"]
    want, got, m = run_both(path, kv_cache_dtype="fp8")
    assert got == want and m["prefix_cache_host_hit_tokens"] > 0
    prompts, _ = conversations()
    params = SamplingParams(max_tokens=24, **GREEDY)
    tight = dict(BASE, num_kv_blocks=12, max_num_batched_tokens=32)
    outs = {}
    for mode in ("recompute", "swap"):
        size = 64 * 4096 / GiB  # 4096 bytes: one block of this model at block size 8 in float32
        with LLM(path, **tight, kv_offloading_size=size, preemption_mode=mode) as llm:
            assert llm.runner.block_bytes == 4096
            outs[mode] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
            m = llm.get_metrics()
        assert m["num_preemptions"] > 0
        if mode == "swap":
            assert m["num_swapped_out_blocks"] > 0 and m["prefix_cache_preempted_host_hit_tokens"] > 0
    assert outs["swap"] == outs["recompute"]


@pytest.mark.slow  # 8 s on 2 cores: run after the README command (.ci/run)
def test_tp2_each_rank_holds_its_shard(tiny_models):
    path = tiny_models["qwen3"]
    want, got, m = run_both(path, tensor_parallel_size=2)
    assert got == want and m["prefix_cache_host_hit_tokens"] > 0


@pytest.mark.parametrize("size, says", [(-1.0, ">= 0"), (1e6, "more than this host can pin"), (1e-6, "no KV block")])
def test_bad_sizes_fail_at_start_up_naming_the_option(tiny_models, size, says):
    with pytest.raises(InvalidRequestError, match=says) as e:
        LLM(tiny_models["qwen3"], **BASE, kv_offloading_size=size)
    assert e.value.param == "kv_offloading_size"


def test_swap_needs_the_tier(tiny_models):
    with pytest.raises(InvalidRequestError) as e:
        LLM(tiny_models["qwen3"], **BASE, preemption_mode="swap")
    assert e.value.param == "preemption_mode"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_host_buffer_round_trips_blocks(dtype):
    kv = torch.randn(2, 3, 10, 2, 4, 8).to(dtype)  # [2, slots, blocks, heads, block_size, dim]
    cache = HostKVCache(kv, 6)
    assert cache.host.dtype == dtype and cache.host.shape == (6, 2, 3, 2, 4, 8)
    before = kv.view(torch.uint8).clone()
    cache.offload([(1, 0), (2, 1), (7, 5), (3, 5)])  # host 5 written twice: the later copy wins
    cache.load([(0, 8), (1, 9), (5, 0)])
    after = kv.view(torch.uint8)
    assert torch.equal(after[:, :, 8], before[:, :, 1]) and torch.equal(after[:, :, 9], before[:, :, 2])
    assert torch.equal(after[:, :, 0], before[:, :, 3])
    untouched = [b for b in range(10) if b not in (0, 8, 9)]
    assert torch.equal(after[:, :, untouched], before[:, :, untouched])
    assert _runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    cache.close()


@pytest.mark.parametrize(
    "family, extra",
    [
        ("qwen3", {}),
        ("llama", {}),
        ("qwen3", {"kv_cache_dtype": "fp8"}),
        pytest.param("qwen3", {"tensor_parallel_size": 2}, marks=pytest.mark.slow),  # each rank prefetches its shard
    ],
    ids=["qwen3", "llama", "fp8", "tp2"],
)
def test_prefetched_loads_give_the_same_outputs(tiny_models, family, extra):
    """Every second turn sent at once behind a token budget smaller than the turns: the requests the
    budget leaves waiting have their host hits prefetched beside the step (num_prefetched_blocks),
    and the outputs equal the tier-off ones."""
    path = tiny_models[family]
    first, second = conversations(n=6)
    params = SamplingParams(max_tokens=4, **GREEDY)

    def turns(llm: LLM) -> list[list[int]]:
        out = [list(r.outputs[0].token_ids) for r in llm.generate(first, params, use_tqdm=False)]
        return out + [list(r.outputs[0].token_ids) for r in llm.generate(second, params, use_tqdm=False)]

    kw = {**BASE, "num_kv_blocks": 20, "max_num_batched_tokens": 16, **extra}
    with LLM(path, **kw) as off:
        want = turns(off)
        size = host_gib(off, 64) * kw.get("tensor_parallel_size", 1)
    with LLM(path, **kw, kv_offloading_size=size) as on:
        got = turns(on)
        m = on.get_metrics()
    assert got == want
    assert m["num_prefetched_blocks"] > 0 and m["num_loaded_blocks"] >= m["num_prefetched_blocks"]
