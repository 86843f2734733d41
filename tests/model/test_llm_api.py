"""The LLM API: sampling, stops, errors, detokenization."""

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["qwen3"], num_kv_blocks=128, block_size=8)


def tokens(out):
    return out.outputs[0].token_ids


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = tokens(llm.generate([[5, 6, 7]], p, use_tqdm=False)[0])
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (3, 20, 7)]
    batch = llm.generate(
        [[9, 9], [5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [40]], [others[0], p, others[1], others[2]], use_tqdm=False
    )
    assert tokens(batch[1]) == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12, ignore_eos=True)
    assert tokens(llm.generate([[5, 6, 7]], different_seed, use_tqdm=False)[0]) != alone


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(
        [[3, 4, 5, 6]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0]
    topk1 = llm.generate(
        [[3, 4, 5, 6]], SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0]
    assert tokens(greedy) == tokens(topk1)


def test_min_p_and_top_p_restrict_to_the_argmax_when_tight(llm):
    greedy = tokens(
        llm.generate([[7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    )
    for p in (
        SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8, ignore_eos=True),
    ):
        assert tokens(llm.generate([[7, 8]], p, use_tqdm=False)[0]) == greedy


def test_stop_token_ids_and_stop_strings(llm):
    base = llm.generate(["def fib"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    stop_tok = base.token_ids[4]
    k = base.token_ids.index(stop_tok)
    out = llm.generate(
        ["def fib"],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == base.token_ids[: k + 1] and out.finish_reason == "stop"
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop
    out = llm.generate(
        ["def fib"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[: text.find(stop)]
    assert base.finish_reason == "length"


def test_bad_input_raises_and_llm_keeps_working(llm):
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 2, 10**6]], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 600], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1], [2]], [SamplingParams()], use_tqdm=False)
    # every prompt is checked before any is queued; the error names the field at fault
    for prompts, params, param in (
        ([[1, 2], [1, 2, 10**6]], None, "prompt"),
        ([[1, 2], [1] * 600], None, "prompt"),
        ([[1, 2], [1, 2]], [SamplingParams(), "greedy"], "sampling_params"),
        ([[1, 2]], [SamplingParams(), SamplingParams()], "sampling_params"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(prompts, params, use_tqdm=False)
        assert e.value.param == param, e.value
    # nothing from the failed calls is left queued
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(tokens(out[0])) == 4


def test_unknown_keyword_and_bad_paths(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="unknown LLM argument.*bogus"):
        LLM(tiny_models["qwen3"], bogus=1)
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="supported: .*Qwen3ForCausalLM"):
        LLM(str(tmp_path))


def test_llm_argument_errors_name_the_argument(tiny_models, tmp_path):
    for kwargs, param in (
        ({"bogus": 1}, "bogus"),
        ({"gpu_memory_utilization": 2.0}, "gpu_memory_utilization"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"async_scheduling": "yes"}, "async_scheduling"),
        ({"max_model_len": 10**6}, "max_model_len"),
        ({"generation_config": str(tmp_path)}, "generation_config"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            LLM(tiny_models["qwen3"], device="cpu", num_kv_blocks=16, **kwargs)
        assert e.value.param == param, e.value
    with pytest.raises(InvalidRequestError) as e:
        LLM(str(tmp_path / "nope"))
    assert e.value.param == "model"


def test_prompt_forms_and_output_shape(llm):
    outs = llm.generate(
        ["def ", [5, 6], {"prompt_token_ids": [7, 8, 9]}],
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.prompt for o in outs] == ["def ", None, None]
    assert outs[1].prompt_token_ids == [5, 6] and outs[2].prompt_token_ids == [7, 8, 9]
    for o in outs:
        assert o.finished and len(o.outputs[0].token_ids) == 3 and o.outputs[0].finish_reason == "length"
        assert isinstance(o.request_id, str) and isinstance(o.outputs[0].text, str)
    single = llm.generate("def ", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert tokens(single[0]) == tokens(outs[0])


def test_incremental_detokenizer_never_splits_multibyte_characters(llm):
    tok = llm.get_tokenizer()
    text = "héllo wörld — ünïcode ✓ 你好 ok"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    pieces = [detok.step([i]) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # byte tokens of a single multi-byte char: nothing is emitted until it is complete
    char = "你"
    byte_level = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(char)[0][0]  # one symbol per UTF-8 byte
    byte_ids = [tok.convert_tokens_to_ids(b) for b in byte_level]
    assert len(ids) > 0 and len(byte_ids) >= 1
    assert len(byte_ids) == len(char.encode("utf-8")) == 3 and None not in byte_ids
    assert tok.decode(byte_ids) == char
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.step([i]) for i in byte_ids] == ["", "", char]


def test_async_scheduling_keeps_seeded_sampling_and_stops(tiny_models):
    sync = LLM(tiny_models["qwen3"], num_kv_blocks=128, block_size=8)
    async_ = LLM(tiny_models["qwen3"], num_kv_blocks=128, block_size=8, async_scheduling=True)
    assert async_.engine.async_scheduling
    prompts = [[5, 6, 7], [9, 9], list(range(1, 30))]
    params = [
        SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=15, ignore_eos=True),
    ]
    a = sync.generate(prompts, params, use_tqdm=False)
    b = async_.generate(prompts, params, use_tqdm=False)
    assert [tokens(o) for o in a] == [tokens(o) for o in b]
    stop_tok = tokens(a[1])[3]
    p = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, stop_token_ids=[stop_tok])
    assert tokens(async_.generate([[9, 9]], p, use_tqdm=False)[0]) == tokens(a[1])[: tokens(a[1]).index(stop_tok) + 1]
    m = async_.get_metrics()
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]


def test_greedy_row_in_a_sampled_batch_stays_greedy(llm):
    g = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = tokens(llm.generate([[5, 6, 7]], g, use_tqdm=False)[0])
    mixed = llm.generate(
        [[9, 9], [5, 6, 7]], [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True), g], use_tqdm=False
    )
    assert tokens(mixed[1]) == alone


def test_philox_sampling_path_seeded_reproducible_fused_or_not(tiny_models):
    """The CUDA sampling path (Philox row seeds; fused Gumbel-max kernel, or the torch path fed
    the same noise when a row needs top-p), run here on CPU through Triton's interpreter."""
    llm = LLM(tiny_models["qwen3"], num_kv_blocks=128, block_size=8)
    llm.runner.philox_sampling = True
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = tokens(llm.generate([[5, 6, 7]], p, use_tqdm=False)[0])  # fused kernel
    others = [
        SamplingParams(temperature=0.9, top_p=0.8, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    batch = llm.generate([[9, 9], [5, 6, 7], [3, 4, 5, 6]], [others[0], p, others[1]], use_tqdm=False)
    assert tokens(batch[1]) == alone  # torch path with the same noise, then fused
    greedy = tokens(llm.generate([[3, 4, 5, 6]], others[1], use_tqdm=False)[0])
    assert tokens(batch[2]) == greedy  # a greedy row stays greedy
    again = tokens(llm.generate([[5, 6, 7]], p, use_tqdm=False)[0])
    assert again == alone
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    assert tokens(llm.generate([[5, 6, 7]], other_seed, use_tqdm=False)[0]) != alone
    assert len(set(alone)) > 1  # it samples, not a constant


def test_async_scheduling_default_is_auto_and_validated(tiny_models):
    cpu = LLM(tiny_models["qwen3"], device="cpu", num_kv_blocks=32, block_size=8)
    assert cpu.engine.async_scheduling is False  # auto: off on CPU (nothing to overlap)
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(tiny_models["qwen3"], device="cpu", num_kv_blocks=32, block_size=8, async_scheduling="yes")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_generation_tokens_count_the_tokens_returned(async_scheduling):
    """num_generation_tokens counts the tokens outputs carry: with async scheduling a row sampled
    for a sequence preempted (or finished) after its step launched is thrown away, not generated
    (it counted once: 721 for 720 returned here before)."""
    from pagedllm import default_model_path

    kw = dict(num_kv_blocks=24, block_size=8, max_num_seqs=8, max_model_len=256, async_scheduling=async_scheduling)
    with LLM(default_model_path(), **kw) as llm:
        prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 1 for j in range(20 + i)]} for i in range(12)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)
        m = llm.get_metrics()
    assert m["num_preemptions"] > 0
    assert m["num_generation_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs)
