"""Speculative decoding through LLM on CPU with real models: greedy output with n-gram speculation
equals greedy output without it, token for token, for every tiny family and the bundled model,
with copy-heavy prompts (proposals accepted) and random ones, under forced preemption, with
prefix caching on and off; seeded sampling draws the same tokens whatever the batch; logprobs
come one per token; refusals name the field."""

import random

import pytest

from pagedllm import LLM, SamplingParams, default_model_path
from pagedllm.engine.errors import InvalidRequestError
from tests.helpers import FAMILIES

# proposing at every batch size (the default stops above 16 running sequences), so every test verifies
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "disable_by_batch_size": None,
}


def workload(vocab: int, seed: int = 0):
    """Copy-heavy prompts (a phrase repeated: the greedy continuation of a tiny random model
    tends to loop, and a loop is what prompt lookup proposes) and random ones."""
    rng = random.Random(seed)
    prompts = []
    for i in range(6):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 8))]
        prompts.append(phrase * 4 if i % 2 == 0 else [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 30))])
    return prompts


def greedy(llm, prompts, max_tokens=24):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]


def run_pair(path, prompts, **kw):
    outs, metrics = [], None
    for spec in (None, SPEC):
        with LLM(path, device="cpu", block_size=8, speculative_config=spec, **kw) as llm:
            outs.append(greedy(llm, prompts))
            metrics = llm.get_metrics()
            assert metrics["num_free_kv_blocks"] == metrics["num_kv_blocks"]
    return outs, metrics


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_speculation_equals_without(tiny_models, family):
    prompts = workload(200, seed=len(family))
    (plain, spec), m = run_pair(tiny_models[family], prompts, num_kv_blocks=128)
    assert spec == plain
    assert m["spec_decode_num_accepted_tokens"] > 0, m


def test_under_preemption_and_without_prefix_caching(tiny_models):
    prompts = workload(200, seed=5)
    (plain, spec), m = run_pair(tiny_models["qwen3"], prompts, num_kv_blocks=12, max_num_seqs=6)
    assert spec == plain and m["num_preemptions"] > 0 and m["spec_decode_num_accepted_tokens"] > 0
    (plain2, spec2), _ = run_pair(tiny_models["qwen3"], prompts, num_kv_blocks=128, enable_prefix_caching=False)
    assert spec2 == plain2 == plain


@pytest.mark.parametrize("pause", [True, False])
def test_async_scheduling_with_speculation(tiny_models, pause):
    """The real runner's async path: a step that proposes waits for the one in flight; while
    speculation is paused (pause: Backoff as it is; else never) steps run ahead."""
    prompts = workload(200, seed=11)
    with LLM(tiny_models["llama"], device="cpu", block_size=8, num_kv_blocks=128, async_scheduling=True) as llm:
        plain = greedy(llm, prompts, 40)
    with LLM(
        tiny_models["llama"],
        device="cpu",
        block_size=8,
        num_kv_blocks=128,
        async_scheduling=True,
        speculative_config=SPEC,
    ) as llm:
        assert llm.engine.async_scheduling
        if not pause:
            llm.engine.scheduler.speculator.backoff.FLOOR = 0.0
        assert greedy(llm, prompts, 40) == plain
        m = llm.get_metrics()
        assert m["spec_decode_num_drafts"] > 0 and m["num_free_kv_blocks"] == m["num_kv_blocks"]


def test_the_bundled_model(tiny_models):
    with LLM(default_model_path(), device="cpu", num_kv_blocks=64) as llm:
        text = "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat"
        ids = llm.tokenizer.encode(text)
        prompts = [ids, ids[5:], workload(llm.hf_config.vocab_size, seed=9)[1]]
        plain = greedy(llm, prompts, 16)
    with LLM(default_model_path(), device="cpu", num_kv_blocks=64, speculative_config=SPEC) as llm:
        llm.engine.scheduler.speculator.backoff.FLOOR = 0.0  # it would pause: its outputs rarely copy
        assert greedy(llm, prompts, 16) == plain
        assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0


def test_seeded_sampling_and_logprobs_are_the_same_with_or_without_speculation(tiny_models):
    """A seeded row's draw is keyed by (seed, position): with speculation the same tokens come out,
    in any batch company, with one logprobs entry per token (its own row's)."""
    prompts = workload(200, seed=3)
    params = [
        SamplingParams(temperature=0.8, top_k=20, seed=100 + i, max_tokens=16, logprobs=2) for i in range(len(prompts))
    ]

    def run(llm, order):
        outs = llm.generate(
            [{"prompt_token_ids": prompts[i]} for i in order], [params[i] for i in order], use_tqdm=False
        )
        return {
            i: (o.outputs[0].token_ids, [sorted(d) for d in o.outputs[0].logprobs])
            for i, o in zip(order, outs, strict=True)
        }

    with LLM(tiny_models["qwen3"], device="cpu", num_kv_blocks=128) as llm:
        plain = run(llm, range(len(prompts)))
    with LLM(tiny_models["qwen3"], device="cpu", num_kv_blocks=128, speculative_config=SPEC) as llm:
        assert run(llm, range(len(prompts))) == plain
        assert run(llm, [3, 1]) == {i: plain[i] for i in (3, 1)}  # other batch company
        assert llm.get_metrics()["spec_decode_num_drafts"] > 0


def test_refusals_name_the_field(tiny_models):
    path = tiny_models["qwen3"]
    for config, field in [
        ({"model": path, "method": "ngram", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"method": "ngram", "num_speculative_tokens": -1}, "speculative_config.num_speculative_tokens"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            LLM(path, device="cpu", num_kv_blocks=16, speculative_config=config)
        assert e.value.param == field


def test_structured_output_penalties_and_n_behave_as_without_speculation():
    """The grammar checks each proposal (proposals stop before the first it refuses) and each
    verification row's mask is the grammar's after the proposals before it; penalties count the
    proposals before a row as output. Seeded, so the outputs are the same tokens with or without."""
    from tests.engine.test_structured_output import CASES, valid

    cases = ["json_schema", "regex", "lark", "choice"]
    params = []
    for i, case in enumerate(cases):
        so = CASES[case]
        params.append(SamplingParams(temperature=0, max_tokens=60, structured_outputs=so))
        params.append(SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=60, structured_outputs=so))
    params.append(SamplingParams(temperature=0.7, seed=5, max_tokens=30, presence_penalty=0.7, repetition_penalty=1.3))
    params.append(SamplingParams(temperature=0, max_tokens=30, frequency_penalty=0.5, bad_words=["the cat"]))
    prompt = "def main(): return main() + main() + main()"
    runs = []
    for spec in (None, SPEC):
        with LLM(
            default_model_path(),
            device="cpu",
            num_kv_blocks=128,
            block_size=8,
            max_model_len=256,
            speculative_config=spec,
        ) as llm:
            outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
            runs.append([[o.token_ids for o in out.outputs] for out in outs])
            for out, p in zip(outs, params[: 2 * len(cases)], strict=False):
                assert all(valid(o.text, p.structured_outputs) for o in out.outputs), [o.text for o in out.outputs]
            if spec is not None:
                assert llm.get_metrics()["spec_decode_num_drafts"] > 0
    assert runs[1] == runs[0]


@pytest.fixture(scope="module")
def window_families(tiny_models, tmp_path_factory):
    from tests.model.families import family_checkpoints

    return family_checkpoints(tiny_models["qwen3"], tmp_path_factory)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "phi3", "mistral", "qwen2"])
def test_windowed_and_soft_capped_families(window_families, kind):
    """Sliding-window groups (a rollback trims every group's table; the window's blocks are given
    back relative to the step's first position, as for a plain decode) and soft caps, past the
    window of 32 tokens; speculation never pauses here."""
    prompts = [p * 3 for p in workload(300, seed=12)]  # 9 .. 90 tokens, then 40 more
    outs = []
    for spec in (None, SPEC):
        with LLM(window_families[kind], device="cpu", block_size=8, num_kv_blocks=160, speculative_config=spec) as llm:
            if spec is not None:
                llm.engine.scheduler.speculator.backoff.FLOOR = 0.0
            outs.append(greedy(llm, prompts, 40))
            m = llm.get_metrics()
            assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
    assert outs[1] == outs[0]
    assert m["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.slow  # 9 s on 2 cores: run after the README command (.ci/run)
def test_tensor_parallel(tiny_models):
    """TP = 2 (gloo on CPU): rank 0 builds the verification step's inputs once for both ranks."""
    prompts = workload(200, seed=13)
    outs = []
    for spec in (None, SPEC):
        with LLM(
            tiny_models["qwen3"],
            device="cpu",
            block_size=8,
            num_kv_blocks=64,
            tensor_parallel_size=2,
            speculative_config=spec,
        ) as llm:
            outs.append(greedy(llm, prompts, 24))
            if spec is not None:
                assert llm.get_metrics()["spec_decode_num_drafts"] > 0
    assert outs[1] == outs[0]


def test_the_sampled_ids_buffers_take_every_verified_row(tiny_models):
    """A verification step samples 1 + k rows a sequence, more than max_num_seqs: the pinned buffers
    that a CUDA step's ids are copied into (worker/step_handle.py) hold one row per scheduled token.
    (The CPU path never copies through them; on the H200 at 9f0abf7 buffers of max_num_seqs rows
    failed tests/gpu/test_spec_decode_gpu.py's preemption test: 14 rows into 12.)"""
    with LLM(tiny_models["qwen3"], max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64) as llm:
        assert all(buf.numel() >= 64 for buf in llm.runner._host_ids)
