"""Draft-model speculative decoding through LLM on CPU: greedy output with a draft equals greedy
output without, token for token, for every tiny family and the bundled model; the target as its
own draft accepts every proposal (float32 greedy: the draft's KV, indexed by the target's block
tables, holds exactly what it should), also under forced preemption, with prefix caching off and
with chunked prefill; a smaller draft (the target's first layer) and a draft of another family
change nothing but acceptance; sampled tokens keep the target's distribution (chi-square);
seeded requests, n > 1, stop strings, max_tokens and structured output behave as without; the
pool is sized from one budget for both models' KV; refusals name the field."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams, default_model_path
from pagedllm.engine.errors import InvalidRequestError
from tests.helpers import FAMILIES, load_script
from tests.model.test_spec_decode_llm import greedy, workload
from tests.worker.test_spec_sampling import chi_square_ok


def draft(path: str, k: int = 3) -> dict:
    """Proposing at every batch size (the default stops above 16 running sequences)."""
    return {"model": path, "num_speculative_tokens": k, "disable_by_batch_size": None}


def run_pair(path: str, spec: dict, prompts, max_tokens: int = 24, **kw):
    """Greedy outputs without and with `spec`, and the speculative engine's metrics (speculation
    never pauses: every decode step verifies proposals)."""
    outs, metrics = [], {}
    for s in (None, spec):
        with LLM(path, device="cpu", block_size=8, speculative_config=s, **kw) as llm:
            if s is not None:
                llm.engine.scheduler.speculator.backoff.FLOOR = 0.0
            outs.append(greedy(llm, prompts, max_tokens))
            metrics = llm.get_metrics()
            assert metrics["num_free_kv_blocks"] == metrics["num_kv_blocks"]
    return outs, metrics


@pytest.fixture(scope="module")
def small_draft(tiny_models, tmp_path_factory):
    """qwen3's first layer, its embedding, final norm and head: a draft of the same vocabulary."""
    bench = load_script("benchmarks/spec_decode.py")
    return bench.truncated_draft(tiny_models["qwen3"], str(tmp_path_factory.mktemp("draft") / "qwen3-1layer"), 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_target_as_its_own_draft_accepts_every_proposal(tiny_models, family):
    path = tiny_models[family]
    (plain, spec), m = run_pair(path, draft(path), workload(200, seed=len(family)), num_kv_blocks=128)
    assert spec == plain
    assert m["spec_decode_num_drafts"] > 0 and m["spec_decode_acceptance_rate"] == 1.0, m


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_kv_blocks=14, max_num_seqs=6),  # forced preemption (recompute; resumes re-hit their prefix)
        dict(num_kv_blocks=128, enable_prefix_caching=False),
        dict(num_kv_blocks=128, max_num_batched_tokens=16),  # chunked prefill, and proposals cut by the budget
    ],
    ids=["preemption", "no-prefix-caching", "chunked-prefill"],
)
def test_the_draft_kv_stays_in_step(tiny_models, kw):
    path = tiny_models["qwen3"]
    prompts = workload(200, seed=5) + [p * 2 for p in workload(200, seed=6)]
    (plain, spec), m = run_pair(path, draft(path, 4), prompts, 32, **kw)
    assert spec == plain
    assert m["spec_decode_acceptance_rate"] == 1.0, m
    if "max_num_seqs" in kw:
        assert m["num_preemptions"] > 0


def test_a_smaller_draft_and_a_draft_of_another_family(tiny_models, small_draft):
    path = tiny_models["qwen3"]
    prompts = workload(200, seed=7)
    (plain, spec), m = run_pair(path, draft(small_draft, 2), prompts, num_kv_blocks=128)
    assert spec == plain and m["spec_decode_num_drafts"] > 0
    (plain2, spec2), m = run_pair(path, draft(tiny_models["llama"], 2), prompts, num_kv_blocks=128)
    assert spec2 == plain2 == plain and m["spec_decode_num_drafts"] > 0


def test_the_bundled_model(tiny_models, small_draft):
    path = default_model_path()
    with LLM(path, device="cpu") as llm:
        ids = llm.tokenizer.encode("The cat sat on the mat. The dog sat on the log. The cat")
    prompts = [ids, ids[4:], workload(300, seed=9)[1]]
    (plain, spec), m = run_pair(path, draft(path), prompts, 16, num_kv_blocks=64)
    assert spec == plain and m["spec_decode_acceptance_rate"] == 1.0, m


@pytest.mark.parametrize("pause", [True, False])
def test_async_scheduling(tiny_models, pause):
    """Async scheduling: paused steps (a draft of another family is often wrong) run ahead, and
    their draft catch-up reads the token in flight from the device, as the target does."""
    prompts = workload(200, seed=11)
    outs = []
    for spec in (None, draft(tiny_models["llama"], 2)):
        kw = dict(device="cpu", block_size=8, num_kv_blocks=128, async_scheduling=True, speculative_config=spec)
        with LLM(tiny_models["qwen3"], **kw) as llm:
            assert llm.engine.async_scheduling
            if spec is not None and not pause:
                llm.engine.scheduler.speculator.backoff.FLOOR = 0.0
            outs.append(greedy(llm, prompts, 40))
            m = llm.get_metrics()
            assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
    assert outs[1] == outs[0] and m["spec_decode_num_drafts"] > 0


def test_the_draft_runs_only_in_steps_that_propose(tiny_models):
    """Lazy catch-up: with disable_by_batch_size 2, no step proposes while more than 2 of the 6
    requests run, and the draft runs no forward in those steps; when the last two propose, the
    draft first catches up over everything it missed, and the target as its own draft still
    accepts every proposal (its KV is right)."""
    path = tiny_models["qwen3"]
    prompts = workload(200, seed=12)[:6]
    limits = [8, 10, 12, 14, 40, 40]
    spec = {"model": path, "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    outs, calls = [], {"forwards": 0, "steps": 0, "proposing": 0}
    for s in (None, spec):
        with LLM(path, device="cpu", block_size=8, num_kv_blocks=128, speculative_config=s) as llm:
            if s is not None:
                llm.engine.scheduler.speculator.backoff.FLOOR = 0.0
                model, runner = llm.runner.draft.model, llm.runner
                real_forward, real_propose = model.forward, runner.propose_drafts

                def forward(*a, real_forward=real_forward, **kw):
                    calls["forwards"] += 1
                    return real_forward(*a, **kw)

                def propose(out, real_propose=real_propose):
                    calls["steps"] += 1
                    calls["proposing"] += any(x.spec_token_ids for x in out.scheduled)
                    return real_propose(out)

                model.forward, runner.propose_drafts = forward, propose
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in limits]
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            outs.append([o.outputs[0].token_ids for o in res])
            m = llm.get_metrics()
    assert outs[1] == outs[0]
    assert m["spec_decode_num_drafts"] > 0 and m["spec_decode_acceptance_rate"] == 1.0, m
    assert calls["steps"] > calls["proposing"] > 0
    assert 0 < calls["forwards"] <= 4 * calls["proposing"]  # a catch-up and k' = 3 forwards a proposing step


def test_sampled_tokens_keep_the_target_distribution(tiny_models):
    """Each request samples 4 tokens at temperature 1 over the top 2 (so 16 outcomes); with k = 2
    the second step verifies the draft's greedy d_1, d_2 for tokens 2 and 3. The joint law of the
    tokens 1..3 must be the target's, computed here with HF transformers (float32)."""
    from transformers import AutoModelForCausalLM

    path = tiny_models["qwen3"]
    prompt = workload(200, seed=4)[0]
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)

    def top2(prefix):
        with torch.no_grad():
            logits = hf(torch.tensor([prefix])).logits[0, -1].double()
        v, i = logits.topk(2)
        return i.tolist(), v.softmax(-1).tolist()

    outcomes, probs = [], []
    ids0, p0 = top2(prompt)
    for a, pa in zip(ids0, p0, strict=True):
        ids1, p1 = top2(prompt + [a])
        for b, pb in zip(ids1, p1, strict=True):
            ids2, p2 = top2(prompt + [a, b])
            for c, pc in zip(ids2, p2, strict=True):
                outcomes.append((a, b, c))
                probs.append(pa * pb * pc)
    n = 2400
    params = [SamplingParams(temperature=1.0, top_k=2, seed=i, max_tokens=4, ignore_eos=True) for i in range(n)]
    with LLM(path, device="cpu", num_kv_blocks=512, speculative_config=draft(path, 2)) as llm:
        llm.engine.scheduler.speculator.backoff.FLOOR = 0.0
        outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
        m = llm.get_metrics()
    index = {o: i for i, o in enumerate(outcomes)}
    counts = np.zeros(len(outcomes), dtype=np.int64)
    for o in outs:
        counts[index[tuple(o.outputs[0].token_ids[:3])]] += 1
    assert 0 < m["spec_decode_acceptance_rate"] < 1 and m["spec_decode_num_drafts"] >= n, m
    assert chi_square_ok(counts, torch.tensor(probs)), (counts / n, probs)
    assert not chi_square_ok(counts, torch.tensor(sorted(probs)))  # the check can fail


def test_seeded_n_stops_and_structured_output_behave_as_without(tiny_models):
    """Seeded sampling with logprobs, n > 1, a stop string and stop token ids inside accepted runs,
    max_tokens reached mid-run, penalties, and structured output (whose sequences decode without
    proposals: their grammar cannot check proposals not made yet): the same outputs as without."""
    from tests.engine.test_structured_output import CASES, valid

    path = default_model_path()
    params = [
        SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=21, logprobs=2),
        SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=17),
        SamplingParams(temperature=0, max_tokens=40, stop=[" the"], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[13, 11]),
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0.7, seed=5, max_tokens=30, presence_penalty=0.7, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=CASES["json_schema"]),
    ]
    prompt = "The cat sat on the mat. The cat sat on the mat. The cat"
    runs = []
    for spec in (None, draft(path, 3)):
        kw = dict(device="cpu", num_kv_blocks=128, block_size=8, max_model_len=256, speculative_config=spec)
        with LLM(path, **kw) as llm:
            if spec is not None:
                llm.engine.scheduler.speculator.backoff.FLOOR = 0.0
            outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
            runs.append(
                [
                    [(o.token_ids, o.text, o.finish_reason, o.logprobs and len(o.logprobs)) for o in r.outputs]
                    for r in outs
                ]
            )
            assert valid(outs[-1].outputs[0].text, params[-1].structured_outputs)
            m = llm.get_metrics()
            assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
    assert runs[1] == runs[0]
    assert m["spec_decode_num_accepted_tokens"] > 0


def test_one_budget_sizes_both_pools(tiny_models):
    """kv_cache_memory_bytes is shared: the target as its own draft halves the blocks."""
    path = tiny_models["qwen3"]
    budget = 1 << 20
    with LLM(path, device="cpu", kv_cache_memory_bytes=budget) as llm:
        alone = llm.runner.num_kv_blocks
        block = llm.runner.block_bytes
    with LLM(path, device="cpu", kv_cache_memory_bytes=budget, speculative_config=draft(path)) as llm:
        assert llm.runner.num_kv_blocks == budget // (2 * block) == alone // 2
        assert llm.runner.draft.kv_cache.shape[2] == llm.runner.num_kv_blocks


def _copy_model(src: str, dst: str, **config_changes) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.update(config_changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def test_refusals_name_the_field(tiny_models, tmp_path):
    path = tiny_models["qwen3"]
    other_vocab = _copy_model(path, str(tmp_path / "vocab"), vocab_size=400)
    other_tokenizer = _copy_model(path, str(tmp_path / "tok"))
    shutil.copy(os.path.join(default_model_path(), "tokenizer.json"), os.path.join(other_tokenizer, "tokenizer.json"))
    short = _copy_model(path, str(tmp_path / "short"), max_position_embeddings=64)
    field = "speculative_config.model"
    cases = [
        ({"model": str(tmp_path / "missing"), "num_speculative_tokens": 2}, {}, field),
        ({"model": other_vocab, "num_speculative_tokens": 2}, {}, field),
        ({"model": other_tokenizer, "num_speculative_tokens": 2}, {}, field),
        ({"model": short, "num_speculative_tokens": 2}, {}, field),
        ({"model": path, "num_speculative_tokens": 2}, dict(tensor_parallel_size=2), "tensor_parallel_size"),
        ({"model": 3, "num_speculative_tokens": 2}, {}, field),
        ({"model": path, "method": "ngram", "num_speculative_tokens": 2}, {}, field),
        (
            {"model": path, "num_speculative_tokens": 2, "prompt_lookup_max": 3},
            {},
            "speculative_config.prompt_lookup_max",
        ),
        ({"model": path}, {}, "speculative_config.num_speculative_tokens"),
        ({"model": path, "num_speculative_tokens": 0}, {}, "speculative_config.num_speculative_tokens"),
        ({"method": "eagle", "model": path, "num_speculative_tokens": 2}, {}, "speculative_config.method"),
    ]
    for config, kw, name in cases:
        with pytest.raises(InvalidRequestError) as e:
            LLM(path, device="cpu", num_kv_blocks=16, speculative_config=config, **kw)
        assert e.value.param == name, (config, e.value)
    with LLM(path, device="cpu", num_kv_blocks=16, speculative_config=draft(path)) as llm:
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(
                [[1, 2, 3]], SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=4), use_tqdm=False
            )
        assert e.value.param == "use_beam_search"


def test_windowed_models_are_refused(tiny_models, tmp_path_factory):
    from tests.model.families import family_checkpoints

    gemma = family_checkpoints(tiny_models["qwen3"], tmp_path_factory)["gemma2"]
    for target, drafter in [(gemma, tiny_models["qwen3"]), (tiny_models["qwen3"], gemma)]:
        with pytest.raises(InvalidRequestError) as e:
            LLM(target, device="cpu", num_kv_blocks=16, speculative_config=draft(drafter))
        assert e.value.param == "speculative_config.model"
