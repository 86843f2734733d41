import io
import json
import subprocess
import sys

import pytest

from pagedllm.engine import LLMEngine, SamplingParams, SchedulerConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.errors import InvalidRequestError
from tests.engine.fake_runner import CharTokenizer, ShadowRunner, drain, reference_generate


def make_engine(async_scheduling=False, **kw):
    cfg = SchedulerConfig(**{"num_kv_blocks": 32, "block_size": 4, "max_model_len": 64, **kw})
    return LLMEngine(
        cfg,
        ShadowRunner(cfg.block_size),
        tokenizer=CharTokenizer(),
        vocab_size=97,
        eos_token_ids={5},
        async_scheduling=async_scheduling,
    )


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def mode(request):
    return request.param


def test_control_plane_imports_without_torch():
    code = "import sys, pagedllm.engine, pagedllm; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 1.5),
        ("n", 0),
        ("top_k", -2),
        ("min_tokens", -1),
        ("max_tokens", "3"),
    ],
)
def test_sampling_params_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens, p.ignore_eos, p.n) == (
        1.0,
        1.0,
        -1,
        0.0,
        16,
        0,
        False,
        1,
    )
    assert SamplingParams(stop="x").stop_list == ["x"]


def test_admission_checks_and_the_engine_keeps_working():
    engine = make_engine()
    engine.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("b", [1] * 64, SamplingParams())
    with pytest.raises(ValueError, match="KV blocks"):
        make_engine(num_kv_blocks=2).add_request("c", [1] * 10, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("d", [1, 500], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [1], SamplingParams())
    done = drain(engine)
    assert done["ok"].outputs[0].token_ids == reference_generate([1, 2, 3], 4)


def test_length_stops_at_max_tokens_and_past_max_model_len_is_refused(mode):
    engine = make_engine(mode, max_model_len=12)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(InvalidRequestError, match="12 tokens") as e:  # 10 + 50 > 12: refused, not clamped
        engine.add_request("b", [1] * 10, SamplingParams(max_tokens=50, ignore_eos=True))
    assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
    engine.add_request("b", [1] * 10, SamplingParams(max_tokens=2, ignore_eos=True))  # the whole room left
    done = drain(engine)
    assert len(done["a"].outputs[0].token_ids) == 4 and done["a"].outputs[0].finish_reason == "length"
    assert len(done["b"].outputs[0].token_ids) == 2 and done["b"].outputs[0].finish_reason == "length"


def _first_index(tokens, wanted):
    return next(i for i, t in enumerate(tokens) if t in wanted)


def test_stop_token_ids_eos_and_min_tokens(mode):
    prompt = [10, 20, 30]
    ref = reference_generate(prompt, 40)
    stop = ref[5]
    k = _first_index(ref, {stop})
    engine = make_engine(mode)
    engine.add_request("s", prompt, SamplingParams(max_tokens=40, stop_token_ids=[stop], ignore_eos=True))
    engine.add_request(
        "m", prompt, SamplingParams(max_tokens=40, stop_token_ids=[stop], min_tokens=k + 2, ignore_eos=True)
    )
    done = drain(engine)
    assert done["s"].outputs[0].token_ids == ref[: k + 1]
    assert done["s"].outputs[0].finish_reason == "stop" and done["s"].outputs[0].stop_reason == stop
    assert len(done["m"].outputs[0].token_ids) > k + 1


def test_stop_strings_cut_the_text_and_stream_deltas_add_up(mode):
    prompt = "hello"
    ids = CharTokenizer().encode(prompt)
    ref_text = CharTokenizer().decode(reference_generate(ids, 30))
    stop = ref_text[7:9]
    cut = ref_text.find(stop)
    engine = make_engine(mode)
    engine.add_request("x", prompt, SamplingParams(max_tokens=30, stop=[stop, "\x7f\x7f"], ignore_eos=True))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    assert final.outputs[0].text == ref_text[:cut]
    assert "".join(deltas) == final.outputs[0].text
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_abort_frees_blocks_at_once(mode):
    engine = make_engine(mode)
    engine.add_request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    assert engine.abort_request("a")
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    if mode:  # async: the step in flight still has to land
        assert engine.step() == []
    assert not engine.has_unfinished_requests()
    assert not engine.abort_request("a")


def test_metrics_keys_and_values(mode):
    engine = make_engine(mode, num_kv_blocks=64)
    shared = list(range(1, 17))
    engine.add_request("a", shared + [1], SamplingParams(max_tokens=3, ignore_eos=True))
    drain(engine)
    engine.add_request("b", shared + [2], SamplingParams(max_tokens=3, ignore_eos=True))
    drain(engine)
    m = engine.get_metrics()
    for key in [
        "num_kv_blocks",
        "num_free_kv_blocks",
        "kv_cache_usage",
        "num_preemptions",
        "prefix_cache_query_tokens",
        "prefix_cache_hit_tokens",
        "prefix_cache_hit_rate",
        "prefix_cache_requests",
        "prefix_cache_preempted_requests",
        "prefix_cache_preempted_query_tokens",
        "prefix_cache_preempted_hit_tokens",
        "num_prompt_tokens",
        "num_generation_tokens",
        "num_requests_running",
        "num_requests_waiting",
    ]:
        assert key in m
    assert m["prefix_cache_hit_tokens"] == 16 and m["prefix_cache_query_tokens"] == 34
    assert m["prefix_cache_requests"] == 2 and m["num_preemptions"] == m["prefix_cache_preempted_requests"] == 0
    assert m["num_prompt_tokens"] == 34 and m["num_generation_tokens"] == 6
    assert m["num_free_kv_blocks"] == 64 and m["kv_cache_usage"] == 0.0


def test_n_greater_than_one_gives_n_completions(mode):
    engine = make_engine(mode, num_kv_blocks=64)
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    out = drain(engine)["a"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(o.token_ids == reference_generate([1, 2, 3, 4, 5], 4) for o in out.outputs)


def test_trace_events_are_json_lines():
    sink = io.StringIO()
    engine = LLMEngine(
        SchedulerConfig(num_kv_blocks=8, block_size=4, max_model_len=64, trace_blocks=True),
        ShadowRunner(4),
        trace_sink=sink,
    )
    engine.add_request("a", [1] * 9, SamplingParams(max_tokens=2, ignore_eos=True))
    drain(engine)
    events = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert {e["event"] for e in events} >= {"ALLOCATE", "RELEASE"}
    assert set(events[0]) == {"event", "block_id", "seq_id", "ref_cnt", "num_free", "group"}


def test_the_core_ships_token_ids_only():
    """EngineCore (what the server's core process runs) needs no tokenizer: its outputs are token
    ids, one EngineCoreOutput per sequence and step; an engine without a tokenizer gives text ""."""
    engine = make_engine()
    request = engine.input_processor.process("a", "hello", SamplingParams(max_tokens=5, ignore_eos=True))
    core = EngineCore(engine.config, ShadowRunner(engine.config.block_size))
    core.add_request(request)
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    assert [t for o in outs for t in o.new_token_ids] == reference_generate(request.prompt_token_ids, 5)
    assert [o.finish_reason for o in outs] == [None] * 4 + ["length"]
    assert all(o.request_id == "a" and o.index == 0 and not hasattr(o, "text") for o in outs)
    bare = LLMEngine(engine.config, ShadowRunner(engine.config.block_size))
    bare.add_request("a", request.prompt_token_ids, SamplingParams(max_tokens=5, ignore_eos=True))
    out = drain(bare)["a"].outputs[0]
    assert out.text == "" and len(out.token_ids) == 5


def test_a_checked_request_is_queued_as_it_is():
    engine = make_engine()
    request = engine.input_processor.process("a", "hello", SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.add_request(None, request, stream=False) == "a"
    with pytest.raises(ValueError, match="already in use") as e:
        engine.add_request(None, request)
    assert e.value.param == "request_id"
    out = drain(engine)["a"]
    assert out.prompt == "hello" and out.outputs[0].token_ids == reference_generate(request.prompt_token_ids, 3)
    assert out.metrics.arrival_time == request.arrival_time
