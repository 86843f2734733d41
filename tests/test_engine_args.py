"""The engine flag table (pagedllm/entrypoints/args.py): one flag per LLM argument, derived from
LLM's signature, shared by `generate`, `serve` and `bench throughput`."""

from __future__ import annotations

import argparse
import collections
import inspect

import pytest

from pagedllm.entrypoints import args as engine_args
from pagedllm.entrypoints import cli
from pagedllm.entrypoints.llm import LLM, LLM_ARGUMENTS

SIGNATURE = [
    n for n, p in inspect.signature(LLM.__init__).parameters.items() if n != "self" and p.kind != p.VAR_KEYWORD
]


def engine_parser(**defaults) -> argparse.ArgumentParser:
    return engine_args.add_engine_args(argparse.ArgumentParser(), defaults)


def test_every_llm_argument_has_exactly_one_flag():
    parser = engine_parser()
    dests = collections.Counter(a.dest for a in parser._actions if a.dest != "help")
    assert set(dests) == set(SIGNATURE) and set(dests.values()) == {1}
    assert set(engine_args.ENGINE_DESTS) == set(LLM_ARGUMENTS) | {"model"}
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {
        "--block-size",
        "-tp",
        "--no-enable-prefix-caching",
        "--no-async-scheduling",
        "--generation-config",
    } <= flags


def test_an_llm_argument_without_a_flag_fails():
    class Grown(LLM):
        def __init__(self, model: str, *, new_knob: int = 3, **kwargs):
            super().__init__(model, **kwargs)

    with pytest.raises(TypeError, match="new_knob"):
        engine_args._build_table(Grown)


def test_flags_parse_into_llm_keywords():
    p = engine_parser()
    args = p.parse_args(
        [
            "--model",
            "m",
            "--no-enable-prefix-caching",
            "-tp",
            "2",
            "--kv-cache-memory-bytes",
            "512MiB",
            "--block-size",
            "32",
            "--enforce-eager",
            "--dtype",
            "float32",
            "--generation-config",
            "vllm",
        ]
    )
    assert engine_args.engine_kwargs(args) == {
        "model": "m",
        "enable_prefix_caching": False,
        "tensor_parallel_size": 2,
        "kv_cache_memory_bytes": 512 << 20,
        "block_size": 32,
        "enforce_eager": True,
        "dtype": "float32",
        "generation_config": "vllm",
    }
    assert engine_args.engine_kwargs(p.parse_args(["--model", "m"])) == {"model": "m"}  # LLM's defaults apply
    for flag, value in (("--async-scheduling", True), ("--no-async-scheduling", False)):
        assert engine_args.engine_kwargs(p.parse_args(["--model", "m", flag]))["async_scheduling"] is value
    assert cli.engine_kwargs is engine_args.engine_kwargs  # one table, whichever module a command imports


def test_every_flag_given_round_trips_into_the_signature():
    values = {int: "3", float: "0.5", str: "x", dict: '{"method": "ngram", "num_speculative_tokens": 2}'}
    argv = []
    for f in engine_args.ENGINE_FLAGS:
        flag = f.option_strings[0]
        if f.kind is bool:
            argv.append(flag)
        else:
            argv += [flag, f.help.choices[-1] if f.help.choices else values[f.kind]]
    kw = engine_args.engine_kwargs(engine_parser().parse_args(argv))
    assert set(kw) == set(SIGNATURE)  # every argument, under its own name: valid LLM(**kw) keywords
    kinds = {f.dest: f.kind for f in engine_args.ENGINE_FLAGS}
    assert all(isinstance(value, kinds[name]) for name, value in kw.items()), kw


def test_parsed_flags_build_an_llm(tiny_models):
    argv = ["--model", tiny_models["qwen3"], "--device", "cpu", "--num-kv-blocks", "16", "--block-size", "8"]
    argv += ["--no-enable-prefix-caching", "--generation-config", "vllm", "--max-model-len", "256"]
    with LLM(**engine_args.engine_kwargs(engine_parser().parse_args(argv))) as llm:
        assert llm.engine.input_processor.max_model_len == 256 and llm.runner.num_kv_blocks == 16
        assert llm.generation_defaults == {}


def test_bench_throughput_uses_the_table_with_its_own_max_model_len(capsys):
    from pagedllm.bench import throughput

    parser = cli.build_parser(["bench", "throughput"])
    args = parser.parse_args(["bench", "throughput", "--model", "m", "-tp", "2", "--enforce-eager"])
    assert engine_args.engine_kwargs(args) == {
        "model": "m",
        "max_model_len": throughput.STANDARD_MAX_MODEL_LEN,
        "tensor_parallel_size": 2,
        "enforce_eager": True,
    }
    args = parser.parse_args(["bench", "throughput", "--model", "m", "--max-model-len", "2048"])
    assert engine_args.engine_kwargs(args)["max_model_len"] == 2048
    assert cli.main(["bench", "throughput", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(default: 4096 for the standard workload; LLM's: the model's max_position_embeddings)" in help_text
    assert "--generation-config" in help_text and "--no-enable-prefix-caching" in help_text


def test_unknown_command_defaults_are_refused():
    with pytest.raises(ValueError, match="max_len"):
        engine_parser(max_len=4096)


@pytest.mark.parametrize(
    "kwargs, param, needle",
    [
        ({"enable_chunked_prefill": False}, "enable_chunked_prefill", "always prefills"),
        ({"tokenizer_mode": "slow"}, "tokenizer_mode", "auto, hf"),
        ({"quantization": "awq"}, "quantization", "unquantized"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size", "tensor_parallel_size"),
        ({"swap_space": 4}, "swap_space", "unknown LLM argument"),
        ({"revision": "main"}, "revision", "local directory"),
    ],
)
def test_vllm_arguments_pagedllm_cannot_honour_are_refused_by_name(tiny_models, kwargs, param, needle):
    from pagedllm.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=needle) as e:
        LLM(tiny_models["qwen3"], device="cpu", **kwargs)
    assert e.value.param == param


def test_vllm_engine_flags_parse(capsys):
    p = engine_parser()
    args = p.parse_args(["--model", "Qwen/Qwen3-0.6B", "--revision", "main", "--trust-remote-code"])
    assert engine_args.engine_kwargs(args) == {
        "model": "Qwen/Qwen3-0.6B",
        "revision": "main",
        "trust_remote_code": True,
    }
    assert engine_args.engine_kwargs(p.parse_args(["--no-enable-chunked-prefill"]))["enable_chunked_prefill"] is False
    help_text = " ".join(p.format_help().split())
    assert "always on" in help_text and "changes nothing" in help_text and "nothing is downloaded" in help_text
