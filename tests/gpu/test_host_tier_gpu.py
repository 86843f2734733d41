"""The host tier on CUDA: pinned memory, the side stream of offloads, the staging tensor, CUDA
graphs and async scheduling (the CPU tests in tests/model/test_host_tier_llm.py run the same
logic over two host buffers). Greedy outputs with the tier on equal those with it off, with host
hits; the buffer round-trips blocks exactly, also past one staging chunk and when a load reads a
host block whose offload was queued just before it. Run with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker import host_kv_cache
from pagedllm.worker.host_kv_cache import HostKVCache
from tests.model.hf_reference import GREEDY
from tests.model.test_host_tier_llm import BASE, GiB, conversations, run_both

pytestmark = pytest.mark.gpu

CUDA = dict(BASE, device="cuda", dtype="float32")


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("mode", [dict(), dict(async_scheduling=False), dict(enforce_eager=True)], ids=str)
def test_tier_on_equals_tier_off_on_cuda(tiny_models, family, mode):
    want, got, m = run_both(tiny_models[family], device="cuda", dtype="float32", **mode)
    assert got == want
    assert m["prefix_cache_host_hit_tokens"] > 0 and m["num_loaded_blocks"] > 0
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]


def test_fp8_kv_and_swap_on_cuda(tiny_models):
    path = tiny_models["qwen3"]
    want, got, m = run_both(path, device="cuda", dtype="float32", kv_cache_dtype="fp8")
    assert got == want and m["prefix_cache_host_hit_tokens"] > 0
    prompts, _ = conversations()
    params = SamplingParams(max_tokens=24, **GREEDY)
    tight = dict(CUDA, num_kv_blocks=12, max_num_batched_tokens=32)
    outs = {}
    for mode in ("recompute", "swap"):
        with LLM(path, **tight, kv_offloading_size=64 * 4096 / GiB, preemption_mode=mode) as llm:
            outs[mode] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
            m = llm.get_metrics()
        assert m["num_preemptions"] > 0
    assert outs["swap"] == outs["recompute"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_pinned_buffer_round_trips_blocks(monkeypatch, dtype):
    kv = torch.randn(2, 3, 40, 2, 16, 64, device="cuda").to(dtype)
    block = 2 * 3 * 2 * 16 * 64 * kv.element_size()
    monkeypatch.setattr(host_kv_cache, "STAGING_BYTES", 3 * block)  # 3 blocks a chunk: the rest on the main stream
    cache = HostKVCache(kv, 20)
    assert cache.host.is_pinned()  # what allocate_host_kv_cache gives the runner on CUDA
    before = kv.view(torch.uint8).clone()
    pairs = [(g, h) for h, g in enumerate([5, 6, 7, 8, 9, 30, 31, 2])]  # host 0..7
    cache.offload(pairs)
    cache.load([(h, 10 + h) for h in range(8)])  # reads every host block just offloaded
    torch.cuda.synchronize()
    after = kv.view(torch.uint8)
    for g, h in pairs:
        assert torch.equal(after[:, :, 10 + h], before[:, :, g])
    kv.view(torch.uint8)[:, :, :10].zero_()  # the device blocks change: the host copies must not
    cache.load([(h, g) for g, h in pairs])
    torch.cuda.synchronize()
    for g, _ in pairs:
        assert torch.equal(kv.view(torch.uint8)[:, :, g], before[:, :, g])
    cache.close()


@pytest.mark.parametrize("mode", [dict(), dict(enforce_eager=True)], ids=str)
def test_prefetched_loads_on_cuda(tiny_models, mode):
    """The prefetch path on the load stream (the CPU test's workload): outputs equal the tier-off ones."""
    from tests.model.test_host_tier_llm import host_gib

    path = tiny_models["qwen3"]
    first, second = conversations(n=6)
    params = SamplingParams(max_tokens=4, **GREEDY)

    def turns(llm: LLM) -> list[list[int]]:
        out = [list(r.outputs[0].token_ids) for r in llm.generate(first, params, use_tqdm=False)]
        return out + [list(r.outputs[0].token_ids) for r in llm.generate(second, params, use_tqdm=False)]

    kw = {**CUDA, **mode, "num_kv_blocks": 20, "max_num_batched_tokens": 16}
    with LLM(path, **kw) as off:
        want = turns(off)
        size = host_gib(off, 64)
    with LLM(path, **kw, kv_offloading_size=size) as on:
        got = turns(on)
        m = on.get_metrics()
    assert got == want
    assert m["num_prefetched_blocks"] > 0


def test_prefetch_and_offload_streams_keep_their_order():
    """A prefetch (load stream) of host blocks whose offload (offload stream) was just queued reads
    the offloaded KV; an offload queued after a prefetch that reads the same host block does not
    overwrite it first; begin_step makes the current stream wait for the prefetch."""
    kv = torch.randn(2, 2, 64, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
    cache = HostKVCache(kv, 16)
    before = kv.clone()
    torch.cuda._sleep(50_000_000)  # the current stream stays busy: nothing below may run early
    cache.offload([(g, g - 1) for g in range(1, 9)])  # host 0..7 from GPU 1..8
    cache.load([], [(h, 40 + h) for h in range(8)])  # prefetch: reads host 0..7
    cache.offload([(20 + h, h) for h in range(8)])  # overwrites host 0..7 after the prefetch read them
    cache.begin_step()
    got = kv[:, :, 40:48].clone()  # on the current stream: after the prefetch
    torch.cuda.synchronize()
    assert torch.equal(got, before[:, :, 1:9])
    cache.load([(h, 50 + h) for h in range(8)])
    torch.cuda.synchronize()
    assert torch.equal(kv[:, :, 50:58], before[:, :, 20:28])
    cache.close()
