"""Reading a local Hugging Face model directory: config, tokenizer, EOS ids, sampling defaults.

The one place that knows the files of a model directory, used by `LLM` (engine side) and by
AsyncLLM and the server (API side, which loads only the tokenizer). A hub model id
(`Qwen/Qwen3-0.6B`) is found in the local Hugging Face cache (`resolve_model_path`); nothing is
ever downloaded.
"""

from __future__ import annotations

import json
import logging
import os
import re
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
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


# what a hub repo id looks like: `name` or `org/name` (letters, digits, `-`, `_`, `.`)
HUB_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")


def hub_cache_dir(download_dir: str | None = None) -> str:
    """The Hugging Face hub cache, read from the environment at each call (as huggingface_hub
    computes it at import): `download_dir` (vLLM's name), else $HF_HUB_CACHE, else
    $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    env = os.environ
    if download_dir:
        return os.path.expanduser(download_dir)
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return os.path.expanduser(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def resolve_model_path(
    model: str, revision: str | None = None, download_dir: str | None = None, param: str = "model"
) -> str:
    """A local directory as given (`~` expanded), else a hub id's snapshot directory in the local
    Hugging Face cache (`models--Org--Name/snapshots/<commit>/`, `revision` a branch, tag or
    commit; unset: main). Never downloads: an id that is not cached is refused, saying so.
    `revision` and `download_dir` only mean something for a hub id: with a local directory
    they are refused, not ignored."""
    path = os.path.expanduser(os.fspath(model))
    if os.path.isdir(path):
        for name, value in (("revision", revision), ("download_dir", download_dir)):
            if value is not None:
                raise InvalidRequestError(
                    f"{name}={value!r} applies to a Hugging Face hub model id; {model!r} is a local directory", name
                )
        return path
    if os.path.exists(path) or not HUB_ID.fullmatch(path):
        raise InvalidRequestError(
            f"model directory {model!r} does not exist (pagedllm loads local Hugging Face directories "
            "and hub ids already in the local Hugging Face cache; it does not download)",
            param,
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir(download_dir)
    try:
        found = snapshot_download(path, revision=revision, cache_dir=cache, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):
        at = f" at revision {revision!r}" if revision is not None else ""
        raise InvalidRequestError(
            f"model {model!r} is not a local directory and is not in the local Hugging Face cache{at} "
            f"({cache}); pagedllm does not download models: fetch it first (`hf download {model}`) or pass "
            "a directory",
            param,
        ) from None
    logger.debug("%s %r: the cached snapshot %s", param, model, found)
    return str(found)


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
    return out
