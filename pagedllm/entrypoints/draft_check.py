"""speculative_config.model: the draft model's directory checked at start-up, before any weight
loads. Every refusal is an InvalidRequestError naming `speculative_config.model` (or the other
argument that makes the combination unsupported): a missing directory, an architecture pagedllm
cannot run, a vocabulary that differs from the target's (vocab_size, and the tokenizers' vocabularies
where both directories have tokenizer files), a context shorter than max_model_len, sliding-window
attention in either model (the draft's KV is indexed by the target's full-attention block tables:
worker/draft_model.py), a quantized draft checkpoint, and tensor parallelism."""

from __future__ import annotations

from typing import Any

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.spec_config import SpeculativeConfig
from pagedllm.entrypoints.model_dir import load_hf_config, load_tokenizer, resolve_model_path
from pagedllm.worker.draft_model import DraftSpec

FIELD = "speculative_config.model"


def check_draft_model(
    spec: SpeculativeConfig,
    target_config: Any,
    target_tokenizer: Any,
    max_model_len: int,
    tensor_parallel_size: int,
) -> DraftSpec:
    """The draft's config and directory, checked against the target's."""
    assert spec.model is not None, "SpeculativeConfig.parse gives a draft method its model"
    if tensor_parallel_size > 1:
        raise InvalidRequestError(
            f"{FIELD}: a draft model runs with tensor_parallel_size=1 only (got {tensor_parallel_size})",
            "tensor_parallel_size",
        )
    try:
        path = resolve_model_path(spec.model, param=FIELD)
        config = load_hf_config(path)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"{FIELD}: {e.message}", FIELD) from None
    from pagedllm.model.registry import layer_windows

    try:
        windows = layer_windows(config)
    except ValueError as e:
        raise InvalidRequestError(f"{FIELD}: {e}", FIELD) from None
    if any(w is not None for w in windows) or any(w is not None for w in layer_windows(target_config)):
        raise InvalidRequestError(
            f"{FIELD}: a draft model needs full attention in every layer of both models (sliding windows are "
            "not supported with a draft)",
            FIELD,
        )
    if config.vocab_size != target_config.vocab_size:
        raise InvalidRequestError(
            f"{FIELD}: the draft's vocab_size {config.vocab_size} differs from the target's {target_config.vocab_size}",
            FIELD,
        )
    limit = getattr(config, "max_position_embeddings", max_model_len)
    if limit < max_model_len:
        raise InvalidRequestError(
            f"{FIELD}: the draft's max_position_embeddings {limit} is below max_model_len {max_model_len}", FIELD
        )
    if getattr(config, "quantization_config", None):
        raise InvalidRequestError(f"{FIELD}: a quantized draft checkpoint is not supported", FIELD)
    draft_tokenizer = load_tokenizer(path)
    if draft_tokenizer is not None and target_tokenizer is not None:
        if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise InvalidRequestError(f"{FIELD}: the draft's tokenizer vocabulary differs from the target's", FIELD)
    return DraftSpec(config, path, spec.disable_by_batch_size)
