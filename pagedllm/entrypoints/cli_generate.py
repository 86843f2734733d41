"""`pagedllm generate`: complete prompts with a local model; one prompt streams, several batch.

stdout carries only the completions (or JSON lines); logs and the progress bar go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.sampling_params import SamplingParams, sampling_params_with_defaults
from pagedllm.entrypoints.args import LLM_DEFAULTS, RUNTIME_ERROR, USAGE_ERROR, CLIError, engine_kwargs

logger = logging.getLogger("pagedllm")


# ---- sampling flags: SamplingParams holds every rule, the flag only parses ------------------
def _sampling_field(name: str, kind: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    """A flag value parser for SamplingParams field `name`, checked by SamplingParams itself."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        try:
            SamplingParams(**{name: value})
        except InvalidRequestError as e:
            raise argparse.ArgumentTypeError(e.message) from None
        return value

    parse.__name__ = what
    return parse


def build_llm(args: argparse.Namespace):
    from pagedllm import LLM

    return LLM(**engine_kwargs(args))


# ---- generate ---------------------------------------------------------------------------
def sampling_params_from_args(args: argparse.Namespace, defaults: Mapping[str, Any]):
    """The flags the user gave win; the model's generation defaults (`LLM.generation_defaults`)
    fill the rest, then SamplingParams' own (max_tokens: the model's max_new_tokens, else 16).
    `--seed S` seeds the request as well as the engine, so the text equals LLM.generate's and
    the server's for the same prompt and seed."""
    if defaults:
        logger.info("Default sampling parameters from the model: %s (flags override them)", dict(defaults))
    return sampling_params_with_defaults(
        defaults,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        stop=args.stop or None,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
    )


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
        args.max_num_seqs = min(LLM_DEFAULTS["max_num_seqs"], len(prompts))
    llm = build_llm(args)
    try:
        params = sampling_params_from_args(args, llm.generation_defaults)
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
    """Print the prompt, then the completion as the engine produces it, then a newline. Cut
    short (Ctrl-C, an engine error), the partial line is ended first, so that the error the
    CLI prints next starts on a line of its own."""
    engine = llm.engine
    req = engine.input_processor.process("cli-0", prompt, params)  # refused before anything is printed
    request_id = req.request_id
    engine.add_request(request_id, req)  # queued as checked, not validated again
    last = "\n"  # the last character on stdout
    try:
        _write(prompt)
        last = prompt[-1:] or last
        finished = False
        while not finished:
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                delta = out.outputs[0].delta_text
                if delta:
                    _write(delta)
                    last = delta[-1]
                finished = out.finished
            if not engine.has_unfinished_requests():
                break
        _write("\n")
    except BaseException:
        engine.abort_request(request_id)
        if last != "\n":
            try:
                _write("\n")
            except OSError:  # stdout is gone (a closed pipe): nothing to end
                pass
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
    s = p.add_argument_group(
        "sampling",
        "Flags left out take the model's defaults (its generation_config.json; see --generation-config), "
        "then SamplingParams' own. --seed S also seeds each request, so the same prompt and seed give "
        "the same text as LLM.generate and the server.",
    )
    s.add_argument(
        "--max-tokens",
        type=_sampling_field("max_tokens", int, "an integer >= 1"),
        default=None,
        help="most new tokens per prompt (default: the model's max_new_tokens, else 16)",
    )
    s.add_argument(
        "--temperature",
        type=_sampling_field("temperature", float, "a number >= 0"),
        default=None,
        help="0 = greedy (default: the model's, else 1.0)",
    )
    s.add_argument("--top-p", type=_sampling_field("top_p", float, "a number in (0, 1]"), default=None)
    s.add_argument(
        "--top-k",
        type=_sampling_field("top_k", int, "-1, 0 (off) or an integer >= 1"),
        default=None,
        help="-1 or 0 = off",
    )
    s.add_argument("--min-p", type=_sampling_field("min_p", float, "a number in [0, 1]"), default=None)
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
