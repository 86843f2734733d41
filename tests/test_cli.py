"""The `pagedllm` command line: help/version, streaming and batch generate, errors.

Most tests call `main([...])` in-process (capsys); a few spawn `python -m pagedllm` to check
what a user sees: the exit code, a clean stdout and a one-line error without a traceback.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys

import pytest

from pagedllm.entrypoints import cli, cli_generate, model_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = ["--device", "cpu", "--num-kv-blocks", "64"]
PROMPTS = ["def fibonacci(", "import os\n", "The quick brown"]


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedllm", *args], input=stdin, capture_output=True, text=True, timeout=300, cwd=REPO
    )


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("pagedllm: error:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["qwen3"]


@pytest.fixture(scope="module")
def reference(model):
    """Greedy completions of PROMPTS through the Python API (non-streamed)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, device="cpu", num_kv_blocks=64)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    llm.close()
    return {o.prompt: o.outputs[0] for o in outs}


# ---- help and version -------------------------------------------------------------------
def test_help_lists_commands_and_flags(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for word in ("generate", "serve", "bench"):
        assert word in out
    assert cli.main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--top-k",
        "--min-p",
        "--json",
        "--input",
        "--model",
        "--block-size",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--max-model-len",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--gpu-memory-utilization",
        "--enforce-eager",
        "--tensor-parallel-size",
        "--num-kv-blocks",
        "--kv-cache-memory-bytes",
    ):
        assert flag in out, flag


def test_version_subprocess():
    import pagedllm

    r = run_cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"pagedllm {pagedllm.__version__}"


def test_sampling_flags_over_model_defaults_over_samplingparams(tmp_path):
    from pagedllm.entrypoints.model_dir import generation_defaults

    p = argparse.ArgumentParser()
    cli_generate.add_generate_args(p)
    p.add_argument("--seed", type=int, default=None)  # an engine flag; generate gives it to each request too
    sp = cli_generate.sampling_params_from_args(p.parse_args([]), generation_defaults(str(tmp_path)))
    assert (sp.temperature, sp.max_tokens, sp.seed) == (1.0, 16, None)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.95, "do_sample": True}))
    defaults = generation_defaults(str(tmp_path))
    sp = cli_generate.sampling_params_from_args(p.parse_args([]), defaults)
    assert (sp.temperature, sp.top_p, sp.max_tokens) == (0.7, 0.95, 16)  # max_tokens: SamplingParams' 16
    sp = cli_generate.sampling_params_from_args(p.parse_args(["--temperature", "0", "--top-k", "5"]), defaults)
    assert (sp.temperature, sp.top_p, sp.top_k) == (0, 0.95, 5)
    sp = cli_generate.sampling_params_from_args(p.parse_args(["--seed", "7", "--max-tokens", "3"]), defaults)
    assert (sp.seed, sp.max_tokens) == (7, 3)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 40}))
    sp = cli_generate.sampling_params_from_args(p.parse_args([]), generation_defaults(str(tmp_path)))
    assert sp.max_tokens == 40  # the model's max_new_tokens is the default when it sets one
    assert cli_generate.sampling_params_from_args(p.parse_args([]), {}).max_tokens == 16


# ---- generate -----------------------------------------------------------------------------
def test_generate_with_an_fp8_kv_cache(model, capsys):
    rc = cli.main(["generate", PROMPTS[0], "--model", model, *ENGINE, "--max-tokens", "4", "--kv-cache-dtype", "fp8"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.startswith(PROMPTS[0]) and "KV cache: fp8_e4m3" in err


def test_generate_one_prompt_streams(model, reference, capsys, monkeypatch):
    writes = []
    real_write = cli_generate._write
    monkeypatch.setattr(cli_generate, "_write", lambda s: (writes.append(s), real_write(s)))
    prompt = PROMPTS[0]
    rc = cli.main(["generate", prompt, "--model", model, *ENGINE, "--temperature", "0", "--max-tokens", "12"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out == prompt + reference[prompt].text + "\n"
    assert writes[0] == prompt and writes[-1] == "\n"
    assert len(writes) > 3  # the completion arrived in several pieces
    assert "KV cache" in err  # INFO logs go to stderr, not stdout


def test_generate_batch_from_file_json_in_order(model, reference, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    # blank lines are skipped; a JSON line with "prompt" carries a prompt that holds a newline
    path.write_text(PROMPTS[0] + "\n\n" + json.dumps({"prompt": PROMPTS[1]}) + "\n" + PROMPTS[2] + "\n")
    rc = cli.main(
        [
            "generate",
            "--input",
            str(path),
            "--json",
            "--model",
            model,
            *ENGINE,
            "--temperature",
            "0",
            "--max-tokens",
            "12",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS
    for r in rows:
        ref = reference[r["prompt"]]
        assert (r["text"], r["token_ids"], r["finish_reason"]) == (ref.text, list(ref.token_ids), "length")


def test_generate_batch_from_stdin_plain(model, reference, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPTS[0] + "\n" + PROMPTS[2] + "\n"))
    rc = cli.main(["generate", "-", "--model", model, *ENGINE, "--temperature", "0", "--max-tokens", "12"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    expected = [p + reference[p].text + "\n" for p in (PROMPTS[0], PROMPTS[2])]
    assert out == cli_generate.BATCH_SEPARATOR.join(expected)


def test_generate_stdin_json_subprocess(model, reference):
    """End to end: stdout holds only the JSON lines; logs and the progress bar are on stderr."""
    r = run_cli(
        "generate",
        "-",
        "--json",
        "--model",
        model,
        *ENGINE,
        "--temperature",
        "0",
        "--max-tokens",
        "12",
        stdin=PROMPTS[2] + "\n" + PROMPTS[0] + "\n",
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["prompt"] for x in rows] == [PROMPTS[2], PROMPTS[0]]
    assert [x["text"] for x in rows] == [reference[PROMPTS[2]].text, reference[PROMPTS[0]].text]
    assert "KV cache" in r.stderr and "Traceback" not in r.stderr


# ---- errors ----------------------------------------------------------------------------------
def test_missing_model_dir_subprocess(tmp_path):
    r = run_cli("generate", "hi", "--model", str(tmp_path / "nope"), "--device", "cpu")
    assert r.returncode == 1
    assert "does not exist" in one_error_line(r.stderr)
    assert r.stdout == ""


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--max-tokens", "-3"], "--max-tokens"),
        (["--max-tokens", "ten"], "--max-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "1.5"], "--top-p"),
        (["--block-size", "0"], "--block-size"),
        (["--device", "tpu"], "--device"),
        (["--kv-cache-dtype", "int8"], "--kv-cache-dtype"),
        (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_flag_values_are_usage_errors(flags, needle, capsys):
    assert cli.main(["generate", "hi", *flags]) == 2
    out, err = capsys.readouterr()
    assert needle in one_error_line(err) and out == ""


def test_runtime_errors_are_one_line(model, tmp_path, capsys, monkeypatch):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    cases = [
        (["generate", "hi", "--model", str(gpt2), "--device", "cpu"], "unsupported architecture"),
        (["generate", "hi", "--model", str(tmp_path / "nope")], "does not exist"),
        (["generate", "hi", "--model", model, *ENGINE, "--max-model-len", "100000"], "max_model_len"),
        (["generate", "--input", str(empty), "--model", model], "no prompt"),
        (["generate", "--input", str(tmp_path / "missing.txt"), "--model", model], "cannot read --input"),
    ]
    for argv, needle in cases:
        assert cli.main(argv) == 1, argv
        out, err = capsys.readouterr()
        assert needle in one_error_line(err), err
        assert out == ""
    # the default model is used when --model is omitted; if it is missing the error says so
    monkeypatch.setattr(model_dir, "default_model_path", lambda: str(tmp_path / "no_default"))
    assert cli.main(["generate", "hi"]) == 1
    assert "--model" in one_error_line(capsys.readouterr().err)


def test_debug_shows_the_exception(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        cli.main(["--debug", "generate", "hi", "--model", str(tmp_path / "nope")])


def test_missing_optional_subcommand_module(capsys, monkeypatch):
    monkeypatch.setitem(
        cli._OPTIONAL,
        ("serve",),
        ("pagedllm.entrypoints.no_such_server", "serve", "add_server_args", "run_server", True),
    )
    assert cli.main(["serve", "--port", "8000"]) == 1
    assert "not available" in one_error_line(capsys.readouterr().err)
    assert cli.main(["bench"]) == 2  # a group without its subcommand prints its help


def test_ctrl_c_while_streaming_ends_the_partial_line_and_exits_130(model, reference, capsys, monkeypatch):
    from pagedllm.engine.llm_engine import LLMEngine

    real_step, steps = LLMEngine.step, []

    def step_then_interrupt(self):
        steps.append(1)
        if len(steps) == 3:  # after the first two tokens were printed
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step_then_interrupt)
    prompt = PROMPTS[0]
    rc = cli.main(["generate", prompt, "--model", model, *ENGINE, "--temperature", "0", "--max-tokens", "12"])
    out, err = capsys.readouterr()
    assert rc == 130
    partial = out[len(prompt) : -1]  # what was printed before the interrupt, then one newline
    assert out.startswith(prompt) and out.endswith("\n") and not partial.endswith("\n"), out
    assert partial and reference[prompt].text.startswith(partial) and partial != reference[prompt].text
    assert one_error_line(err) == "pagedllm: error: interrupted"


def test_max_tokens_past_the_context_is_a_one_line_error(model, capsys):
    # the tiny model's context is 512 tokens: 100000 new tokens cannot fit (it was clamped once)
    for prompts in ([PROMPTS[0]], PROMPTS):  # one prompt streams, several run as a batch
        argv = ["generate", *prompts, "--model", model, *ENGINE, "--max-tokens", "100000"]
        assert cli.main(argv) == 1
        out, err = capsys.readouterr()
        assert "512" in one_error_line(err) and out == ""


# ---- pagedllm serve: parsing only (no model is loaded) --------------------------------------
def serve_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser(["serve", *argv]).parse_args(["serve", *argv])


def test_serve_takes_the_model_as_positional_or_flag(capsys):
    from pagedllm.entrypoints.openai import launcher

    assert launcher.serve_model(serve_args("Qwen/Qwen3-0.6B")) == "Qwen/Qwen3-0.6B"
    assert launcher.serve_model(serve_args("--model", "m")) == "m"
    assert launcher.serve_model(serve_args("m", "--model", "m")) == "m"
    assert launcher.serve_model(serve_args()) is None  # the bundled model
    assert cli.main(["serve", "a", "--model", "b", "--port", "1"]) == 2  # refused before binding or loading
    assert "given twice and differs: 'a' (positional) and --model 'b'" in capsys.readouterr().err


def test_serve_vllm_flags_parse():
    from pagedllm.entrypoints.openai import launcher

    a = serve_args("m", "--served-model-name", "main", "alias", "--allowed-origins", '["https://app.example"]')
    assert a.served_model_name == ["main", "alias"] and a.allowed_origins == ["https://app.example"]
    assert (a.allowed_methods, a.allowed_headers, a.allow_credentials, a.log_requests) == (["*"], ["*"], False, True)
    assert serve_args("--disable-log-requests").log_requests is False
    assert launcher.tool_parser_of(serve_args("--enable-auto-tool-choice", "--tool-call-parser", "hermes")) == "hermes"
    assert launcher.tool_parser_of(serve_args()) is None
    for flags, needle in (
        (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
        (["--tool-call-parser", "hermes"], "only with --enable-auto-tool-choice"),
    ):
        with pytest.raises(cli.CLIError, match=needle):
            launcher.tool_parser_of(serve_args(*flags))


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--allowed-origins", "https://a.example"], "JSON list of strings"),
        (["--allowed-methods", '{"a": 1}'], "JSON list of strings"),
        (["--tool-call-parser", "mistral"], "invalid choice"),
        (["--tokenizer-mode", "slow"], "invalid choice"),
        (["--stream-interval", "0"], "--stream-interval: must be an integer >= 1, got 0"),
    ],
)
def test_bad_serve_flags_are_usage_errors(flags, needle, capsys):
    assert cli.main(["serve", *flags]) == 2
    assert needle in capsys.readouterr().err


def test_chat_template_is_a_file_or_an_inline_template(tmp_path):
    from pagedllm.entrypoints.openai.launcher import chat_template_text

    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(inline)
    assert chat_template_text(str(tmp_path / "t.jinja")) == inline
    assert chat_template_text(inline) == inline
    with pytest.raises(cli.CLIError, match="no such file, and not a Jinja template"):
        chat_template_text(str(tmp_path / "missing.jinja"))


def test_serve_help_documents_the_vllm_flags(capsys):
    assert cli.main(["serve", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("MODEL", "--chat-template", "--allowed-origins", "--disable-log-requests", "always on"):
        assert needle in text
