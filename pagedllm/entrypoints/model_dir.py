"""Reading a local Hugging Face model directory: config, tokenizer, EOS ids, sampling defaults.

The one place that knows the files of a model directory, used by `LLM` (engine side) and by
AsyncLLM and the server (API side, which loads only the tokenizer). No hub downloads.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from pagedllm.engine.errors import InvalidRequestError

logger = logging.getLogger("pagedllm")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# generation_config.json key -> SamplingParams field, as vLLM's `--generation-config auto` reads them
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}
# keys that change sampling but that pagedllm does not implement (yet): warned about, never silently used
UNSUPPORTED_GENERATION_KEYS = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def default_model_path() -> str:
    """The small Qwen3-architecture model trained on the Python standard library, shipped in the package."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "default_model")


def bundled_model_path() -> str:
    """default_model_path(), refused with a clear message when this installation lacks the model."""
    path = default_model_path()
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise InvalidRequestError(
            f"the bundled default model is missing from {path} (this installation has no "
            "model.safetensors/config.json there); pass a model directory (--model DIR)",
            "model",
        )
    return path


def load_hf_config(model: str) -> Any:
    if not os.path.isdir(model):
        raise InvalidRequestError(
            f"model directory {model!r} does not exist (pagedllm loads local Hugging Face "
            "directories; no hub downloads)",
            "model",
        )
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise InvalidRequestError(f"model directory {model!r} has no config.json", "model")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model)
    except (ValueError, KeyError) as e:
        with open(os.path.join(model, "config.json")) as f:
            archs = json.load(f).get("architectures")
        from pagedllm.model.registry import SUPPORTED_ARCHITECTURES

        raise InvalidRequestError(
            f"unsupported architecture {archs}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}", "model"
        ) from e


def load_tokenizer(path: str) -> Any:
    """The directory's tokenizer, or None when it has no tokenizer files (token-id prompts only)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def eos_token_ids(model: str, hf_config: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a sequence: the config's, generation_config.json's and the tokenizer's."""
    ids: set[int] = set()
    candidates = [getattr(hf_config, "eos_token_id", None)]
    candidates.append(_read_json(os.path.join(model, "generation_config.json")).get("eos_token_id"))
    if tokenizer is not None:
        candidates.append(tokenizer.eos_token_id)
    for c in candidates:
        if isinstance(c, int) and not isinstance(c, bool):
            ids.add(c)
        elif isinstance(c, list):
            ids.update(x for x in c if isinstance(x, int) and not isinstance(x, bool))
    return ids


def generation_defaults(model: str, generation_config: str = "auto") -> dict[str, Any]:
    """SamplingParams fields the model's generation_config.json sets (vLLM's `--generation-config`):
    "auto" reads the model directory's file, "vllm" uses none (SamplingParams' own defaults), any
    other value is a directory holding a generation_config.json. Keys the file leaves out are
    left out; a request's own fields always win over these."""
    if generation_config == "vllm":
        return {}
    folder = model if generation_config == "auto" else generation_config
    if generation_config != "auto" and not os.path.isfile(os.path.join(folder, "generation_config.json")):
        raise InvalidRequestError(
            f"generation_config {generation_config!r} is not 'auto', 'vllm' or a directory holding a "
            "generation_config.json",
            "generation_config",
        )
    cfg = _read_json(os.path.join(folder, "generation_config.json"))
    out: dict[str, Any] = {}
    for key, field in GENERATION_CONFIG_FIELDS.items():
        v = cfg.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[field] = v
    for key, neutral in UNSUPPORTED_GENERATION_KEYS.items():
        if cfg.get(key) not in (None, neutral):
            logger.warning(
                "%s sets %s=%r, which pagedllm does not implement; it is not applied",
                os.path.join(folder, "generation_config.json"),
                key,
                cfg[key],
            )
    return out
