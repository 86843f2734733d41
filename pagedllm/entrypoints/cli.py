"""The `pagedllm` command line: `generate`, `serve`, `bench throughput`, `bench serve`.

Flags follow vLLM's spellings. stdout carries only results (completions, JSON lines);
logs, progress bars and errors go to stderr. An error is one line, `pagedllm: error: ...`,
with exit code 2 for a usage error and 1 for a failure at run time; `--debug` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from pagedllm import __version__, default_model_path

logger = logging.getLogger("pagedllm")

USAGE_ERROR, RUNTIME_ERROR = 2, 1
DEFAULT_MAX_TOKENS = 128


class CLIError(Exception):
    """A failure with a message meant for the user (exit code 1 unless told otherwise)."""

    def __init__(self, message: str, code: int = RUNTIME_ERROR):
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `pagedllm: error: <message> (see '<prog> --help')`."""

    help_prog: str | None = None  # the top-level parser points at the subcommand's help

    def error(self, message: str):
        raise CLIError(f"{message} (see '{self.help_prog or self.prog} --help')", USAGE_ERROR)


# ---- argument types (argparse turns ArgumentTypeError into "argument --x: <message>") -----
def _number(kind: Callable[[str], Any], ok: Callable[[Any], bool], what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = _number(int, lambda v: v >= 1, "an integer >= 1")
nonnegative_float = _number(float, lambda v: v >= 0, "a number >= 0")
unit_interval_open = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
unit_interval = _number(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")
top_k_int = _number(int, lambda v: v >= -1, "-1, 0 (off) or an integer >= 1")
any_int = _number(int, lambda v: True, "an integer")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
}


def byte_size(text: str) -> int:
    """`1073741824`, `512MiB`, `2GiB`, `1.5G` -> bytes."""
    s = text.strip().lower().replace(" ", "")
    i = len(s)
    while i and s[i - 1].isalpha():
        i -= 1
    try:
        value = float(s[:i]) * _SIZE_UNITS[s[i:]]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes such as 536870912, 512MiB or 2GiB, got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return int(value)


# ---- engine arguments, shared by every subcommand that builds an LLM ---------------------
def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every `LLM(...)` argument with vLLM's flag spelling. Defaults are left to `LLM`
    (each flag defaults to None and `engine_kwargs` drops what was not given)."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="local Hugging Face model directory (default: the bundled model, pagedllm.default_model_path())",
    )
    g.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer directory (default: --model)")
    g.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
        help="weight and activation dtype; auto = float32 on CPU, the config's dtype on GPU",
    )
    g.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"], help="default: auto (cuda if available)")
    g.add_argument("--block-size", type=positive_int, default=None, help="tokens per KV block (default: 16)")
    g.add_argument("--max-num-seqs", type=positive_int, default=None, help="most sequences in one step (default: 256)")
    g.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help="token budget of one step; longer prompts are prefilled in chunks (default: 8192)",
    )
    g.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="prompt + output limit (default: the model's max_position_embeddings)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV of shared prompt prefixes (default: on)",
    )
    g.add_argument(
        "--num-kv-blocks",
        type=positive_int,
        default=None,
        help="size the KV cache by block count (overrides the memory-based sizing)",
    )
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=byte_size,
        default=None,
        metavar="BYTES",
        help="size the KV cache in bytes, e.g. 512MiB or 2GiB",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=unit_interval_open,
        default=None,
        metavar="FRACTION",
        help="fraction of GPU memory the engine may use, weights + activations + KV (default: 0.9)",
    )
    g.add_argument("--enforce-eager", action="store_true", default=None, help="do not capture CUDA graphs")
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=None,
        metavar="N",
        help="GPUs to shard the model over (default: 1)",
    )
    g.add_argument(
        "--seed", type=any_int, default=None, help="random seed of the engine; makes sampling reproducible (default: 0)"
    )
    g.add_argument(
        "--trace-blocks", action="store_true", default=None, help="write the KV block lifecycle as JSON lines to stderr"
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule the next step while the GPU runs this one (default: on with one "
        "GPU, off on CPU and with tensor parallelism)",
    )
    return parser


_ENGINE_DESTS = [
    "model",
    "tokenizer",
    "dtype",
    "device",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "enable_prefix_caching",
    "num_kv_blocks",
    "kv_cache_memory_bytes",
    "gpu_memory_utilization",
    "enforce_eager",
    "tensor_parallel_size",
    "seed",
    "trace_blocks",
    "async_scheduling",
]


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `LLM(...)` keyword arguments the user gave; `model` is always set (the bundled
    model when --model is omitted)."""
    kwargs = {d: getattr(args, d) for d in _ENGINE_DESTS if getattr(args, d, None) is not None}
    kwargs["model"] = resolve_model(kwargs.get("model"))
    return kwargs


def resolve_model(model: str | None) -> str:
    if model is not None:
        return os.path.expanduser(model)
    path = default_model_path()
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CLIError(
            f"the bundled default model is missing from {path} (this installation has no "
            "model.safetensors/config.json there); pass --model DIR"
        )
    return path


def build_llm(args: argparse.Namespace):
    from pagedllm import LLM

    return LLM(**engine_kwargs(args))


# ---- generate ---------------------------------------------------------------------------
_GEN_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p")


def model_sampling_defaults(model: str) -> dict[str, Any]:
    """The sampling defaults a model ships in generation_config.json (what vLLM uses with its
    default `--generation-config auto`); keys the file does not set are left out."""
    path = os.path.join(model, "generation_config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return {
        k: cfg[k] for k in _GEN_CONFIG_KEYS if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg.get(k), bool)
    }


def sampling_params_from_args(args: argparse.Namespace, model: str):
    from pagedllm import SamplingParams

    values: dict[str, Any] = {"temperature": 1.0}
    from_model = model_sampling_defaults(model)
    if from_model:
        logger.info(
            "Default sampling parameters from %s: %s (flags override them)",
            os.path.join(model, "generation_config.json"),
            from_model,
        )
    values.update(from_model)
    for key in _GEN_CONFIG_KEYS:
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    return SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, stop=args.stop or None, **values)


def _read_prompt_lines(stream) -> list[str]:
    """One prompt per line. Blank lines are skipped; a line holding a JSON object with a
    "prompt" string (e.g. `--json` output) uses that string, so prompts may contain newlines."""
    prompts = []
    for line in stream:
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                line = obj["prompt"]
        prompts.append(line)
    return prompts


def collect_prompts(args: argparse.Namespace) -> tuple[list[str], bool]:
    """-> (prompts, batch). `-` among the positional prompts reads stdin in its place."""
    prompts: list[str] = []
    batch = len(args.prompts) > 1 or args.input is not None
    for p in args.prompts:
        if p == "-":
            prompts.extend(_read_prompt_lines(sys.stdin))
            batch = True
        else:
            prompts.append(p)
    if args.input is not None:
        if args.input == "-":
            prompts.extend(_read_prompt_lines(sys.stdin))
        else:
            try:
                with open(args.input, encoding="utf-8") as f:
                    prompts.extend(_read_prompt_lines(f))
            except OSError as e:
                raise CLIError(f"cannot read --input {args.input!r}: {e.strerror or e}") from e
    if not prompts:
        raise CLIError(
            "no prompt given: pass PROMPT, '-' to read prompts from stdin, or --input FILE",
            USAGE_ERROR if not (args.input or "-" in args.prompts) else RUNTIME_ERROR,
        )
    return prompts, batch


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _json_line(out) -> str:
    c = out.outputs[0]
    return (
        json.dumps(
            {"prompt": out.prompt, "text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason},
            ensure_ascii=False,
        )
        + "\n"
    )


BATCH_SEPARATOR = "-" * 40 + "\n"


def run_generate(args: argparse.Namespace) -> int:
    prompts, batch = collect_prompts(args)
    if args.max_num_seqs is None:
        # no more requests will come: a smaller limit keeps the automatic KV-cache sizing
        # (on CPU: max_num_seqs full-length sequences) and CUDA-graph capture small
        args.max_num_seqs = min(256, len(prompts))
    llm = build_llm(args)
    try:
        params = sampling_params_from_args(args, llm.model_path)
        if batch or args.json:
            outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
            for i, out in enumerate(outputs):
                if args.json:
                    _write(_json_line(out))
                else:
                    _write((BATCH_SEPARATOR if i else "") + prompts[i] + out.outputs[0].text + "\n")
        else:
            stream_one(llm, prompts[0], params)
    finally:
        llm.close()
    return 0


def stream_one(llm, prompt: str, params) -> None:
    """Print the prompt, then the completion as the engine produces it, then a newline."""
    engine = llm.engine
    request_id = "cli-0"
    engine.add_request(request_id, prompt, params)  # validates before anything is printed
    try:
        _write(prompt)
        finished = False
        while not finished:
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                if out.outputs[0].delta_text:
                    _write(out.outputs[0].delta_text)
                finished = out.finished
            if not engine.has_unfinished_requests():
                break
        _write("\n")
    except BaseException:
        engine.abort_request(request_id)
        raise


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "prompts",
        nargs="*",
        metavar="PROMPT",
        help="prompt(s) to complete; one prompt streams, several run as one batch; "
        "'-' reads one prompt per line from stdin",
    )
    p.add_argument(
        "--input",
        "-i",
        metavar="FILE",
        default=None,
        help="read prompts from FILE, one per line ('-' = stdin); a line may be a JSON object with a \"prompt\" string",
    )
    s = p.add_argument_group("sampling (defaults: the model's generation_config.json, else temperature 1.0)")
    s.add_argument(
        "--max-tokens",
        type=positive_int,
        default=DEFAULT_MAX_TOKENS,
        help=f"most new tokens per prompt (default: {DEFAULT_MAX_TOKENS})",
    )
    s.add_argument("--temperature", type=nonnegative_float, default=None, help="0 = greedy")
    s.add_argument("--top-p", type=unit_interval_open, default=None)
    s.add_argument("--top-k", type=top_k_int, default=None, help="-1 or 0 = off")
    s.add_argument("--min-p", type=unit_interval, default=None)
    s.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="STR",
        help="stop when the completion produces STR (repeatable; STR is not printed)",
    )
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per prompt and line: prompt, text, token_ids, finish_reason",
    )


# ---- optional subcommands implemented in other modules -----------------------------------
def _import_optional(module: str, what: str, extra: str | None):
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise CLIError(f"'{what}' is not available: this installation of pagedllm has no {module}") from e
        hint = f"; install it with: pip install 'pagedllm[{extra}]'" if extra else ""
        raise CLIError(f"'{what}' needs the Python package {e.name!r}{hint}") from e


_OPTIONAL = {
    # subcommand path: (module, extra, add-args function, run function, add_engine_args first?)
    # (a bench module that builds an LLM calls add_engine_args itself, for the flags it honours)
    ("serve",): ("pagedllm.entrypoints.server", "serve", "add_server_args", "run_server", True),
    ("bench", "throughput"): ("pagedllm.bench.throughput", None, "add_args", "main", False),
    ("bench", "serve"): ("pagedllm.bench.serving", "serve", "add_args", "main", False),
}


def _subcommand_words(argv: list[str]) -> list[str]:
    """The leading positional words of argv (global flags skipped): which parsers to fill."""
    words = []
    for a in argv:
        if a == "--":
            break
        if a.startswith("-"):
            if words:
                break
            continue
        words.append(a)
        if len(words) == 2:
            break
    return words


def _fill_optional(p: argparse.ArgumentParser, path: tuple[str, ...], wanted: list[str]) -> None:
    """Add the arguments of a subcommand whose code lives elsewhere, only when it is the one
    being run (so `pagedllm generate` never imports the server). A missing module is
    reported only when that subcommand is run."""
    module, extra, add_fn, run_fn, engine_first = _OPTIONAL[path]
    if list(path) != wanted[: len(path)]:
        return
    mod = _import_optional(module, "pagedllm " + " ".join(path), extra)  # CLIError if missing
    if engine_first:
        add_engine_args(p)
    getattr(mod, add_fn)(p)
    p.set_defaults(_run=getattr(mod, run_fn))


# ---- the parser ---------------------------------------------------------------------------
def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    wanted = _subcommand_words(list(argv or []))
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks and DEBUG logs")
    parser = _Parser(
        prog="pagedllm",
        parents=[debug],
        description="pagedllm: vLLM's design (PagedAttention, prefix caching, continuous batching) in readable Python.",
        epilog="Run 'pagedllm COMMAND --help' for a command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"pagedllm {__version__}")
    parser.help_prog = " ".join(["pagedllm"] + wanted[: 1 if wanted[:1] != ["bench"] else 2])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    fmt = argparse.ArgumentDefaultsHelpFormatter
    g = sub.add_parser(
        "generate",
        parents=[debug],
        help="complete prompts (streams one, batches several)",
        description="Complete prompts with a local model (the bundled one by default). "
        "One prompt streams to stdout; several prompts, '-' or --input run "
        "as one batch with a progress bar on stderr.",
        epilog="examples:\n"
        "  pagedllm generate 'def fibonacci('\n"
        "  pagedllm generate --temperature 0 --max-tokens 64 'import '\n"
        "  printf 'import \\ndef \\n' | pagedllm generate - --json\n"
        "  pagedllm generate --input prompts.txt --model ~/models/Qwen3-0.6B --device cuda",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_generate_args(g)
    add_engine_args(g)
    g.set_defaults(_run=run_generate)

    s = sub.add_parser("serve", parents=[debug], help="OpenAI-compatible HTTP server", conflict_handler="resolve")
    _fill_optional(s, ("serve",), wanted)

    b = sub.add_parser("bench", parents=[debug], help="benchmarks: throughput (offline), serve (HTTP)")
    bsub = b.add_subparsers(dest="bench_command", metavar="BENCHMARK", parser_class=_Parser)
    bt = bsub.add_parser(
        "throughput",
        parents=[debug],
        help="offline throughput of LLM.generate",
        conflict_handler="resolve",
        formatter_class=fmt,
    )
    _fill_optional(bt, ("bench", "throughput"), wanted)
    bs = bsub.add_parser(
        "serve", parents=[debug], help="load test of a running server", conflict_handler="resolve", formatter_class=fmt
    )
    _fill_optional(bs, ("bench", "serve"), wanted)
    b.set_defaults(_help=b)
    return parser


# ---- logging and main -------------------------------------------------------------------
class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (so redirection and test capture work)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def setup_logging(debug: bool) -> None:
    level = os.environ.get("PAGEDLLM_LOGGING_LEVEL", "DEBUG" if debug else "INFO").upper()
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if debug else getattr(logging, level, logging.INFO))


def _error(message: str) -> None:
    message = " ".join(str(message).split()) or "unknown error"
    print(f"pagedllm: error: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv[: argv.index("--")] if "--" in argv else "--debug" in argv
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        setup_logging(debug)
        if getattr(args, "_help", None) is not None and getattr(args, "bench_command", None) is None:
            args._help.print_help()
            return USAGE_ERROR
        if getattr(args, "_run", None) is None:
            parser.print_help()
            return 0 if not argv else USAGE_ERROR
        return int(args._run(args) or 0)
    except SystemExit as e:  # --help, --version, or a callee's sys.exit
        return e.code if isinstance(e.code, int) else (0 if e.code is None else RUNTIME_ERROR)
    except KeyboardInterrupt:
        if debug:
            raise
        _error("interrupted")
        return 130
    except BrokenPipeError:  # `pagedllm generate ... | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except CLIError as e:
        if debug and e.code != USAGE_ERROR:
            raise
        _error(str(e))
        return e.code
    except ValueError as e:
        if debug:
            raise
        _error(str(e))
        return RUNTIME_ERROR
    except Exception as e:  # noqa: BLE001  (one line unless --debug)
        if debug:
            raise
        _error(f"{type(e).__name__}: {e}")
        return RUNTIME_ERROR


if __name__ == "__main__":
    sys.exit(main())
