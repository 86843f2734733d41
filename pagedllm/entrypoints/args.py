"""The engine flags: one table, derived from `LLM.__init__`'s signature.

Every command that builds an engine (`pagedllm generate`, `pagedllm serve`, `pagedllm bench
throughput`) adds these flags with `add_engine_args` and turns the parsed namespace back into
`LLM(...)` keywords with `engine_kwargs`. Names, defaults and value types come from the
signature (`block_size: int = 16` -> `--block-size`, a positive integer, "default: 16"; a bool
-> `--x/--no-x`); only the help text, and a parser where the annotation says too little, are
written here. An LLM argument without an entry in FLAG_HELP fails at import (and in
tests/test_engine_args.py), so the table cannot fall behind the class.

Also here, for every command alike: CLIError and the exit codes (2 usage, 1 run time).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.config import KV_CACHE_DTYPES, PREEMPTION_MODES, PREFIX_CACHING_HASH_ALGOS, QUANTIZATION_METHODS
from pagedllm.entrypoints import model_dir
from pagedllm.entrypoints.llm import LLM

USAGE_ERROR, RUNTIME_ERROR = 2, 1  # the command line's exit codes


class CLIError(Exception):
    """A failure with a message meant for the user of a command (exit code 1 unless told otherwise)."""

    def __init__(self, message: str, code: int = RUNTIME_ERROR):
        super().__init__(message)
        self.code = code


# ---- value parsers (argparse turns ArgumentTypeError into "argument --x: <message>") -----
def number(kind: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = number(int, lambda v: v >= 1, "an integer >= 1")
any_int = number(int, lambda v: True, "an integer")
unit_interval_open = number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
_SIZE_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30})


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


def json_object(text: str) -> dict[str, Any]:
    """`{"method": "ngram", ...}` -> a dict (its keys and values are LLM's to check)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


# ---- the table ------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlagHelp:
    """What the signature cannot say about one LLM argument."""

    help: str
    default: str | None = None  # the default in words, where the signature's value is None or absent
    type: Callable[[str], Any] | None = None  # else from the annotation: int -> positive_int, str, float
    choices: tuple[str, ...] | None = None  # the fixed set LLM accepts
    metavar: str | None = None
    alias: str | None = None  # a short spelling (vLLM's `-tp`)


FLAG_HELP: dict[str, FlagHelp] = {
    "model": FlagHelp(
        "a local Hugging Face model directory, or a hub id (Qwen/Qwen3-0.6B) already in the local Hugging Face "
        "cache ($HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub); nothing is downloaded",
        "the bundled model, pagedllm.default_model_path()",
        metavar="DIR|ID",
    ),
    "tokenizer": FlagHelp("tokenizer directory or cached hub id", "--model", metavar="DIR|ID"),
    "revision": FlagHelp(
        "branch, tag or commit of a hub id's cached snapshot (a local directory has none)", "main", metavar="REV"
    ),
    "download_dir": FlagHelp(
        "the Hugging Face cache to find a hub id in (pagedllm never downloads into it)", "$HF_HUB_CACHE", metavar="DIR"
    ),
    "tokenizer_mode": FlagHelp(
        "auto and hf both load Hugging Face's tokenizer (the fast one where there is one)", choices=("auto", "hf")
    ),
    "trust_remote_code": FlagHelp(
        "accepted for vLLM's command lines and changes nothing: pagedllm never runs a model's own code; "
        "it runs the architectures it implements, and any other fails naming it"
    ),
    "enable_chunked_prefill": FlagHelp(
        "always on: a prompt longer than --max-num-batched-tokens is prefilled over several steps "
        "(--no-enable-chunked-prefill is refused)"
    ),
    "dtype": FlagHelp(
        "weight and activation dtype; auto = float32 on CPU, the config's dtype on GPU",
        choices=("auto", "float32", "float", "bfloat16", "float16", "half"),
    ),
    "device": FlagHelp("where the model runs; auto = cuda if available", choices=("auto", "cpu", "cuda")),
    "block_size": FlagHelp("tokens per KV block"),
    "enable_prefix_caching": FlagHelp("reuse the KV of shared prompt prefixes"),
    "prefix_caching_hash_algo": FlagHelp(
        "block hash of the prefix cache: xxhash (xxh64 with a per-process random seed) or sha256",
        choices=PREFIX_CACHING_HASH_ALGOS,
    ),
    "max_num_seqs": FlagHelp("most sequences in one step"),
    "max_num_batched_tokens": FlagHelp("token budget of one step; longer prompts are prefilled in chunks"),
    "max_model_len": FlagHelp("prompt + output limit", "the model's max_position_embeddings"),
    "num_kv_blocks": FlagHelp(
        "size the KV cache by block count (overrides the memory-based sizing)", "sized from memory"
    ),
    "kv_cache_memory_bytes": FlagHelp(
        "size the KV cache in bytes, e.g. 512MiB or 2GiB", "sized from memory", type=byte_size, metavar="BYTES"
    ),
    "gpu_memory_utilization": FlagHelp(
        "fraction of GPU memory the engine may use, weights + activations + KV",
        type=unit_interval_open,
        metavar="FRACTION",
    ),
    "enforce_eager": FlagHelp("do not capture CUDA graphs"),
    "tensor_parallel_size": FlagHelp("GPUs to shard the model over", metavar="N", alias="-tp"),
    "seed": FlagHelp("random seed of the engine; makes sampling reproducible", type=any_int),
    "trace_blocks": FlagHelp("write the KV block lifecycle as JSON lines to stderr"),
    "async_scheduling": FlagHelp(
        "schedule the next step while the GPU runs this one", "on with one GPU, off on CPU and with tensor parallelism"
    ),
    "kv_cache_dtype": FlagHelp(
        "KV cache storage: auto = the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2 store one byte per element, "
        "with per-layer K/V scales from the checkpoint or measured at start-up",
        choices=KV_CACHE_DTYPES,
    ),
    "load_format": FlagHelp(
        "auto/safetensors: load the checkpoint; dummy: seeded random weights made on the device "
        "(config.json and tokenizer from --model, no weights read), for benchmarks",
        choices=("auto", "safetensors", "dummy"),
    ),
    "quantization": FlagHelp(
        "fp8 = every decoder linear layer's weight quantized to e4m3 at load with per-channel scales, "
        "activations per token at run time (vLLM's on-the-fly FP8); a quantized checkpoint (FP8, AWQ, GPTQ) is "
        "read from its quantization_config, and this may name its method; default: the checkpoint's own",
        "none",
        choices=QUANTIZATION_METHODS,
    ),
    "kv_offloading_size": FlagHelp(
        "GiB of host memory (pinned on GPU; summed over the tensor-parallel ranks) for a host tier of the prefix "
        "cache: blocks evicted from the GPU pool are kept there and loaded back on a hit; 0 = off",
        type=number(float, lambda v: True, "a number of GiB"),
        metavar="GIB",
    ),
    "preemption_mode": FlagHelp(
        "what a preempted sequence's KV does: recompute = freed and recomputed on resume; swap = written to the "
        "host tier (needs --kv-offloading-size) and loaded back on resume",
        choices=PREEMPTION_MODES,
    ),
    "speculative_config": FlagHelp(
        'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_max": A, "prompt_lookup_min": B} or {"model": DRAFT_DIR, "num_speculative_tokens": K}; '
        "exact: greedy output is unchanged and sampled output keeps the model's distribution "
        "(docs/features/speculative-decoding.md)",
        "off",
        type=json_object,
        metavar="JSON",
    ),
    "generation_config": FlagHelp(
        "sampling defaults of requests that leave fields unset: auto = the model's generation_config.json, "
        "vllm = none (SamplingParams' own), or a directory holding a generation_config.json",
        metavar="auto|vllm|DIR",
    ),
}


@dataclass(frozen=True)
class EngineFlag:
    dest: str  # the LLM argument
    kind: type  # int, float, str or bool, from the annotation (None stripped)
    default: Any  # LLM's default; None where LLM decides (or, for `model`, where the CLI does)
    help: FlagHelp

    @property
    def option_strings(self) -> list[str]:
        spelled = "--" + self.dest.replace("_", "-")
        return [spelled, self.help.alias] if self.help.alias else [spelled]

    def default_text(self) -> str:
        if self.help.default is not None:
            return self.help.default
        if self.kind is bool:
            return "on" if self.default else "off"
        return str(self.default)


def _kind(annotation: Any) -> type:
    """`int | None` -> int; the annotation of an LLM argument must be one plain type, optionally None
    (or a dict, given on the command line as JSON)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else annotation
    if typing.get_origin(annotation) is dict:
        return dict
    if annotation not in (int, float, str, bool):
        raise TypeError(f"LLM argument annotated {annotation!r}: the flag table knows int, float, str and bool")
    return typing.cast(type, annotation)


def _build_table(cls: type = LLM) -> tuple[EngineFlag, ...]:
    """One EngineFlag per argument of `cls.__init__`; TypeError for an argument FLAG_HELP lacks."""
    init = cls.__init__  # type: ignore[misc]  # the class's own constructor, read from the class
    hints = typing.get_type_hints(init)
    flags = []
    for name, p in inspect.signature(init).parameters.items():
        if name == "self" or p.kind is inspect.Parameter.VAR_KEYWORD:
            continue
        if name not in FLAG_HELP:
            raise TypeError(f"LLM argument {name!r} has no flag: add it to FLAG_HELP in {__name__}")
        default = None if p.default is inspect.Parameter.empty else p.default
        flags.append(EngineFlag(name, _kind(hints[name]), default, FLAG_HELP[name]))
    stale = set(FLAG_HELP) - {f.dest for f in flags}
    if stale:
        raise TypeError(f"FLAG_HELP names {sorted(stale)}, which LLM does not take")
    return tuple(flags)


ENGINE_FLAGS = _build_table()
ENGINE_DESTS = tuple(f.dest for f in ENGINE_FLAGS)
LLM_DEFAULTS: dict[str, Any] = {f.dest: f.default for f in ENGINE_FLAGS if f.dest != "model"}


# ---- argparse ----------------------------------------------------------------------------
def add_engine_args(
    parser: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None, why: str = "this command"
) -> argparse.ArgumentParser:
    """Add one flag per `LLM(...)` argument. Each flag defaults to None (`engine_kwargs` then
    leaves the argument to LLM) unless `defaults` gives a command its own value, which --help
    shows as the default "for <why>" next to LLM's."""
    defaults = dict(defaults or {})
    unknown = set(defaults) - set(ENGINE_DESTS)
    if unknown:
        raise ValueError(f"defaults for unknown engine flags: {sorted(unknown)}")
    g = parser.add_argument_group("engine")
    for f in ENGINE_FLAGS:
        shown = f.default_text()
        if f.dest in defaults:
            shown = f"{defaults[f.dest]} for {why}; LLM's: {shown}"
        kwargs: dict[str, Any] = {
            "dest": f.dest,
            "default": defaults.get(f.dest),
            "help": f"{f.help.help} (default: {shown})".replace("%", "%%"),
        }
        if f.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = f.help.type or {int: positive_int, float: float, str: str}[f.kind]
            kwargs["choices"] = f.help.choices
            kwargs["metavar"] = f.help.metavar
        g.add_argument(*f.option_strings, **kwargs)
    return parser


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `LLM(...)` keyword arguments the user (or the command's defaults) gave; `model` is
    always set (the bundled model when --model is omitted)."""
    kwargs = {d: getattr(args, d) for d in ENGINE_DESTS if getattr(args, d, None) is not None}
    kwargs["model"] = resolve_model(kwargs.get("model"))
    return kwargs


def resolve_model(model: str | None) -> str:
    """--model DIR (with ~ expanded), or the bundled model; refused if that one is missing."""
    return os.path.expanduser(model) if model is not None else model_dir.bundled_model_path()
