"""The sampler's edge cases through the public doors (LLM.generate, LLMEngine over a ModelRunner,
the sampler's `sample`): min_tokens masks EOS and stop ids, top_p == 1 is a no-op whatever the
batch, every accepted seed and top_k works, and all 64 bits of a seed count.

Every test runs on CPU (torch generators) and, marked `gpu`, on CUDA (the tiny models' float32,
CUDA graphs, async scheduling; the fused Gumbel kernel for rows without top-k/top-p, Philox
noise on the torch path)."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from pagedllm import LLM, SamplingParams
from pagedllm.engine import LLMEngine, SchedulerConfig
from pagedllm.ops.sampling import row_seeds
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.sampler import SamplingTensors, apply_top_k_top_p, sample
from tests.engine.fake_runner import drain
from tests.helpers import VOCAB

PROMPT = [5, 6, 7]
# most of the vocabulary: a draw at temperature 1 is almost surely one of them unless masked
MANY = list(range(0, VOCAB - 64))


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    return request.param


@pytest.fixture(scope="module")
def llm(tiny_models, device):
    return LLM(tiny_models["qwen3"], device=device, num_kv_blocks=128, block_size=8)


def tokens(out, i=0):
    return out.outputs[i].token_ids


def first_greedy(llm, prompt=PROMPT):
    p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    return tokens(llm.generate([prompt], p, use_tqdm=False)[0])[0]


# ---------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_a_stop_token_id_for_greedy(llm):
    stop = first_greedy(llm)
    p = SamplingParams(temperature=0, min_tokens=8, max_tokens=8, stop_token_ids=[stop], ignore_eos=True)
    out = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and stop not in out.token_ids
    assert out.finish_reason == "length"
    # once min_tokens are out the stop id may come again
    free = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop], ignore_eos=True)
    assert tokens(llm.generate([PROMPT], free, use_tqdm=False)[0]) == [stop]


@pytest.mark.parametrize("top_p", [1.0, 0.9])  # on CUDA: the fused kernel, the torch path
def test_min_tokens_masks_stop_token_ids_for_seeded_sampling(llm, top_p):
    p = SamplingParams(temperature=1.0, top_p=top_p, seed=7, min_tokens=8, max_tokens=8, stop_token_ids=MANY)
    greedy = SamplingParams(temperature=0, min_tokens=8, max_tokens=8, stop_token_ids=MANY, ignore_eos=True)
    plain = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([PROMPT, [9, 9], PROMPT], [p, plain, greedy], use_tqdm=False)
    for o in (outs[0], outs[2]):
        assert len(tokens(o)) == 8 and not set(tokens(o)) & set(MANY), tokens(o)
    assert set(tokens(outs[1])) & set(MANY)  # the mask is per row: the plain row draws freely


def _engine(model_dir, eos, device, *, async_scheduling=False, max_num_seqs=4):
    hf_config = AutoConfig.from_pretrained(model_dir)
    runner = ModelRunner(
        hf_config,
        model_dir,
        device=torch.device(device),
        dtype=torch.float32,  # as LLM picks for the tiny (float32) models
        block_size=8,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=256,
        max_model_len=256,
        num_kv_blocks=64,
        eos_token_ids=eos,
    )
    cfg = SchedulerConfig(
        num_kv_blocks=runner.num_kv_blocks,
        block_size=8,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=256,
        max_model_len=256,
    )
    return LLMEngine(cfg, runner, eos_token_ids=eos, vocab_size=hf_config.vocab_size, async_scheduling=async_scheduling)


def _run(engine, requests):
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params, stream=False)
    return {rid: out.outputs[0] for rid, out in drain(engine).items()}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_tokens_masks_eos_under_both_schedulings(tiny_models, device, llm, async_scheduling):
    """The scheduler's EOS ids reach the runner; with async scheduling the token being sampled
    is counted with the pending PLACEHOLDERs of the step still in flight."""
    eos = frozenset(MANY)
    engine = _engine(tiny_models["qwen3"], eos, device, async_scheduling=async_scheduling)
    assert engine.async_scheduling == async_scheduling
    done = _run(
        engine,
        [
            ("greedy", PROMPT, SamplingParams(temperature=0, min_tokens=8, max_tokens=8)),
            ("seeded", PROMPT, SamplingParams(temperature=1.0, seed=3, min_tokens=8, max_tokens=8)),
            ("top_p", [9, 9], SamplingParams(temperature=1.0, top_p=0.9, seed=3, min_tokens=8, max_tokens=8)),
            ("three", [1, 2], SamplingParams(temperature=0, min_tokens=3, max_tokens=8)),
            ("ignore", PROMPT, SamplingParams(temperature=0, min_tokens=8, max_tokens=8, ignore_eos=True)),
        ],
    )
    for rid in ("greedy", "seeded", "top_p"):
        assert len(done[rid].token_ids) == 8 and not set(done[rid].token_ids) & eos, (rid, done[rid].token_ids)
    # min_tokens=3: three tokens outside EOS, then the unmasked greedy token is an EOS id
    three = done["three"].token_ids
    assert len(three) == 4 and not set(three[:3]) & eos and three[3] in eos and done["three"].finish_reason == "stop"
    # ignore_eos: EOS ids are not masked (the greedy tokens of the unconstrained run)
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert done["ignore"].token_ids == tokens(llm.generate([PROMPT], free, use_tqdm=False)[0])


def test_min_tokens_masks_the_models_eos_through_llm_generate(tiny_models, device, tmp_path):
    """EOS from the model's generation_config.json: an EOS the greedy continuation hits at once."""
    src = tiny_models["qwen3"]
    probe = LLM(src, device=device, num_kv_blocks=32, block_size=8)
    eos = first_greedy(probe)
    del probe
    model = tmp_path / "eos_model"
    shutil.copytree(src, model)
    with open(os.path.join(model, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [eos]}, f)
    llm = LLM(str(model), device=device, num_kv_blocks=32, block_size=8)
    stopped = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [eos] and stopped.finish_reason == "stop"
    for p in (
        SamplingParams(temperature=0, min_tokens=8, max_tokens=8),
        SamplingParams(temperature=1.0, seed=11, min_tokens=8, max_tokens=8, stop_token_ids=MANY),
    ):
        out = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 8 and eos not in out.token_ids, out.token_ids


# ---------------------------------------------------------------------------- top-p / top-k


def _tensors(device, top_p, seeds):
    """Rows at temperature 1, top_k off, the given top_p; seeded rows as the runner seeds them
    (CUDA: Philox row seeds; CPU: one generator per row). need_min_p (with min_p 0, a no-op)
    keeps a CUDA batch off the fused kernel, so alone and batched rows take the same path."""
    b, v = len(top_p), 151_936
    rs = row_seeds(np.array(seeds, dtype=np.int64), np.full(b, 17, dtype=np.int64))
    cuda = device == "cuda"
    return SamplingTensors(
        temperature=torch.ones(b, device=device),
        top_k=torch.full((b,), v, dtype=torch.int64, device=device),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        min_p=torch.zeros(b, device=device),
        generators=[] if cuda else [torch.Generator().manual_seed(int(s)) for s in rs],
        all_greedy=False,
        any_greedy=False,
        need_top_k_p=any(p < 1 for p in top_p),
        need_min_p=True,
        seeds=torch.from_numpy(rs).to(device) if cuda else None,
    )


def test_top_p_1_and_top_k_off_are_untouched_at_a_real_vocab(device):
    """V = 151,936: a float32 running sum of the sorted probabilities drifts past 1 - p, so a
    top_p=1 row must be left alone explicitly, whatever the other rows ask."""
    v = 151_936
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, v, generator=g) * 3).to(device)  # logits spread like a real model's
    k = torch.tensor([v, v, 50], device=device)
    filtered = apply_top_k_top_p(x, k, torch.tensor([1.0, 0.5, 1.0], device=device))
    assert torch.equal(filtered[0], x[0])  # every token still possible, values untouched
    assert 0 < torch.isfinite(filtered[1]).sum() < v
    assert torch.isfinite(filtered[2]).sum() == 50
    # seeded sampling of top_p=1 rows: the same tokens alone and next to a top_p=0.5 row
    seeds = [3, 4, 5, 6]
    rows = x[:1].expand(len(seeds), -1)
    alone = sample(rows.clone(), _tensors(device, [1.0] * len(seeds), seeds))
    mixed = sample(torch.cat([rows, x[1:2]]), _tensors(device, [1.0] * len(seeds) + [0.5], seeds + [9]))
    assert torch.equal(alone, mixed[:-1])


def test_huge_top_k_generates(llm):
    """top_k up to 2**31 - 1 is valid and k >= V is off; beyond that SamplingParams refuses it
    (so 2**63 never reaches the step as an int64 overflow). One batch: rows are independent."""
    for k in (2**31, 2**63, 2**100):
        with pytest.raises(ValueError, match="top_k"):
            SamplingParams(top_k=k)
    ks = [VOCAB, VOCAB + 1, 2**20, 2**31 - 1]
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=0.999, seed=5, max_tokens=6, ignore_eos=True) for k in ks]
    params.append(SamplingParams(temperature=1.0, top_p=0.999, seed=5, max_tokens=6, ignore_eos=True))
    params.append(SamplingParams(temperature=1.0, top_k=1, max_tokens=6, ignore_eos=True))
    params.append(SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outs = [tokens(o) for o in llm.generate([PROMPT] * len(params), params, use_tqdm=False)]
    assert all(len(t) == 6 for t in outs)
    assert all(t == outs[len(ks)] for t in outs[: len(ks)])
    assert outs[-2] == outs[-1]  # top_k=1 is greedy


# ---------------------------------------------------------------------------- seeds


def _sampled(llm, seeds, n=1, top_p=1.0):
    """Token ids per seed (one batch): temperature 1, 8 tokens; [seed][i] for n > 1."""
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=s, n=n, max_tokens=8, ignore_eos=True) for s in seeds]
    outs = llm.generate([PROMPT] * len(seeds), params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("top_p", [1.0, 0.95])  # on CUDA: the fused kernel, the torch path
def test_all_64_bits_of_a_seed_count(llm, top_p):
    seeds = [7, 7, 7 + 2**32, 7 - 2**32, 7 + 2**62]
    (a,), (b,), *others = _sampled(llm, seeds, top_p=top_p)
    assert a == b
    assert all(o != a for (o,) in others)


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_every_accepted_seed_generates(llm, top_p):
    extremes = [-(2**63), -(2**63) + 1, -1, 0, 2**31, 2**32, 2**63 - 2, 2**63 - 1]
    outs = [o for (o,) in _sampled(llm, extremes, top_p=top_p)]
    assert all(len(t) == 8 for t in outs)
    assert len({tuple(t) for t in outs}) == len(extremes)
    # n > 1: sample i draws with seed + i
    (pair,) = _sampled(llm, [-(2**63)], n=2, top_p=top_p)
    assert pair == outs[:2]


def test_n_samples_reach_seed_max(llm):
    """seed + n - 1 == SEED_MAX is accepted, so its last sample draws with SEED_MAX."""
    (pair,) = _sampled(llm, [2**63 - 2], n=2)
    assert pair == [o for (o,) in _sampled(llm, [2**63 - 2, 2**63 - 1])]
