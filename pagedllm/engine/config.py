"""Engine configuration for the control plane (sizes and policies, no devices)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.spec_config import SpeculativeConfig

PREFIX_CACHING_HASH_ALGOS = ("xxhash", "sha256")
# kv_cache_dtype as users spell it (vLLM's names; "fp8" is e4m3), and what "auto" resolves to: the model's dtype
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
QUANTIZATION_METHODS = (
    "fp8",
    "compressed-tensors",
    "awq",
    "gptq",
)  # `quantization` (vLLM's names): "fp8" quantizes at load an
# unquantized checkpoint (model/quantization.py) or names an FP8 checkpoint; both must agree with the checkpoint's own
# quantization_config (model/quant_config.py)
RESOLVED_KV_CACHE_DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
PREEMPTION_MODES = ("recompute", "swap")  # swap: through the host tier (engine/host_tier.py)


@dataclass
class SchedulerConfig:
    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    trace_blocks: bool = False  # JSON-lines block lifecycle trace on stderr (or a list)
    prefix_caching_hash_algo: str = "xxhash"  # block hash: "xxhash" (xxh64, seeded per process) or "sha256"
    # the KV storage format: as given (KV_CACHE_DTYPES) or as the runner resolved it (reported in metrics)
    kv_cache_dtype: str = "auto"
    num_host_kv_blocks: int = 0  # the host tier's blocks (kv_offloading_size over the block bytes); 0: no tier
    preemption_mode: str = "recompute"
    kv_block_bytes: int = 0  # one block id's KV bytes over every rank (metrics: bytes moved); 0: unknown
    speculative_config: SpeculativeConfig | None = None  # speculative decoding (spec_decode.py); None: off

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", name)
        for name in ("num_host_kv_blocks", "kv_block_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidRequestError(f"{name} must be a non-negative integer, got {value!r}", name)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise InvalidRequestError(
                f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption_mode!r}",
                "preemption_mode",
            )
        if self.preemption_mode == "swap" and not (self.num_host_kv_blocks and self.enable_prefix_caching):
            raise InvalidRequestError(
                "preemption_mode='swap' moves a preempted sequence's blocks to the host tier: it needs "
                "kv_offloading_size > 0 and enable_prefix_caching",
                "preemption_mode",
            )
        if self.prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise InvalidRequestError(
                f"prefix_caching_hash_algo must be one of {', '.join(PREFIX_CACHING_HASH_ALGOS)}, "
                f"got {self.prefix_caching_hash_algo!r}",
                "prefix_caching_hash_algo",
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES + RESOLVED_KV_CACHE_DTYPES:
            raise InvalidRequestError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
                "kv_cache_dtype",
            )
