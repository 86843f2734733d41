"""LLM's argument checks: what `LLM(...)` refuses before anything loads, naming the argument.

Each check raises InvalidRequestError(message, argument) in a fixed order, so a call with several
bad arguments names the same one every time; nothing here reads the model. NOT_SUPPORTED is the
table of vLLM's arguments pagedllm does not take: each accepted at the value that asks for what
pagedllm does anyway, refused (saying why) at any other. The checks that need the model (its
max_position_embeddings, its architecture, a draft model against it) stay in llm.py, after its
config is read.
"""

from __future__ import annotations

from typing import Any

from pagedllm.engine.config import KV_CACHE_DTYPES, PREEMPTION_MODES, QUANTIZATION_METHODS
from pagedllm.engine.errors import InvalidRequestError

# vLLM's LLM arguments that pagedllm does not take: accepted at the value that asks for what
# pagedllm does anyway, refused (naming the argument, saying why) at any other value
NOT_SUPPORTED: dict[str, tuple[Any, str]] = {
    "pipeline_parallel_size": (1, "pagedllm shards a model over GPUs with tensor_parallel_size only"),
    "data_parallel_size": (1, "run one pagedllm engine per replica"),
    "cpu_offload_gb": (0, "pagedllm keeps every weight on the device"),
    "tokenizer_revision": (None, "pass the tokenizer's snapshot directory (tokenizer=DIR) instead"),
    "skip_tokenizer_init": (False, "pagedllm loads the tokenizer when the model has one"),
    "enable_lora": (False, "pagedllm has no LoRA adapters"),
}
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # dummy: seeded random weights, nothing read (benchmarks)
TOKENIZER_MODES = ("auto", "hf")  # both: Hugging Face's AutoTokenizer (the fast tokenizer where there is one)


def check_llm_arguments(
    kwargs: dict[str, Any],
    *,
    enable_chunked_prefill: bool,
    tokenizer_mode: str,
    gpu_memory_utilization: float,
    tensor_parallel_size: int,
    async_scheduling: bool | None,
    load_format: str,
    quantization: str | None,
    kv_cache_dtype: str,
    kv_offloading_size: float,
    enable_prefix_caching: bool,
    preemption_mode: str,
) -> None:
    """Refuse LLM.__init__'s arguments that no model could run with; `kwargs`: its **kwargs."""
    _check_vllm_only(kwargs)
    if not enable_chunked_prefill:
        raise InvalidRequestError(
            "enable_chunked_prefill=False is not supported: pagedllm always prefills a long prompt in "
            "chunks of max_num_batched_tokens",
            "enable_chunked_prefill",
        )
    if tokenizer_mode not in TOKENIZER_MODES:
        raise InvalidRequestError(
            f"tokenizer_mode must be one of {', '.join(TOKENIZER_MODES)} (Hugging Face's tokenizer), "
            f"got {tokenizer_mode!r}",
            "tokenizer_mode",
        )
    if not 0 < gpu_memory_utilization <= 1:
        raise InvalidRequestError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}", "gpu_memory_utilization"
        )
    if tensor_parallel_size < 1:
        raise InvalidRequestError(
            f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}", "tensor_parallel_size"
        )
    if async_scheduling not in (None, True, False):
        raise InvalidRequestError(
            f"async_scheduling must be True, False or None (auto), got {async_scheduling!r}", "async_scheduling"
        )
    if load_format not in LOAD_FORMATS:
        raise InvalidRequestError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}", "load_format"
        )
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise InvalidRequestError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} ('fp8' quantizes an unquantized "
            f"checkpoint at load; either may name an FP8 checkpoint's own method) or None, got {quantization!r}",
            "quantization",
        )
    if kv_cache_dtype not in KV_CACHE_DTYPES:  # the config also takes resolved names; a user gives these
        raise InvalidRequestError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}", "kv_cache_dtype"
        )
    if not kv_offloading_size >= 0:
        raise InvalidRequestError(
            f"kv_offloading_size must be >= 0 GiB (0: no host tier), got {kv_offloading_size}",
            "kv_offloading_size",
        )
    if kv_offloading_size > 0 and not enable_prefix_caching:
        raise InvalidRequestError(
            "kv_offloading_size > 0 keeps evicted prefix-cache blocks in host memory: it needs enable_prefix_caching",
            "kv_offloading_size",
        )
    if preemption_mode not in PREEMPTION_MODES:
        raise InvalidRequestError(
            f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {preemption_mode!r}",
            "preemption_mode",
        )
    if preemption_mode == "swap" and kv_offloading_size <= 0:
        raise InvalidRequestError(
            "preemption_mode='swap' moves a preempted sequence's blocks to the host tier: it needs "
            "kv_offloading_size > 0",
            "preemption_mode",
        )


def _check_vllm_only(kwargs: dict[str, Any]) -> None:
    """Refuse every keyword LLM does not take, except a vLLM argument at its neutral value."""
    unknown = sorted(set(kwargs) - set(NOT_SUPPORTED))
    if unknown:
        raise InvalidRequestError(f"unknown LLM argument(s): {', '.join(unknown)}", unknown[0])
    for name in sorted(kwargs):
        neutral, why = NOT_SUPPORTED[name]
        if kwargs[name] != neutral:
            raise InvalidRequestError(f"LLM argument {name}={kwargs[name]!r} is not supported: {why}", name)
