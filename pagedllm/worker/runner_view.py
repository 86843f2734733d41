"""What the CUDA-graph modules and the kernel warm-up read of the model runner: a protocol.

`ModelRunner` (worker/model_runner.py) builds `DecodeGraphs`, `MixedGraphs`, `PiecewiseGraphs`
and runs `warm_up_kernels`; they take the runner as this narrow view instead of importing
`ModelRunner` back, so the imports run one way (model_runner -> graphs -> this module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pagedllm.engine.kv_cache_groups import KVCacheGroup
    from pagedllm.model.decoder import DecoderForCausalLM
    from pagedllm.ops.attention_metadata import AttentionMetadata


class GraphRunner(Protocol):
    """The sizes, the model and the placeholder fill that every captured graph uses."""

    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    model: DecoderForCausalLM
    kv_cache_groups: tuple[KVCacheGroup, ...]

    def fill_placeholders(self, input_ids: torch.Tensor, fix: Any) -> None: ...


class WarmUpRunner(GraphRunner, Protocol):
    """The start-up forwards (warm_up.py) also build metadata, move inputs, sample, copy blocks and
    size the KV cache."""

    num_kv_blocks: int
    seed: int
    vocab_size: int
    is_driver: bool
    philox_sampling: bool
    kv_cache: Any
    _copy_blocks: Any

    @property
    def block_bytes(self) -> int: ...

    @property
    def pool_block_bytes(self) -> int: ...

    def _to_device(self, a: np.ndarray) -> torch.Tensor: ...

    def _metadata_from(
        self, *, slot_mapping, block_tables, cu, seq_lens, max_q, max_k, decode_only, no_history, groups=(), extra=()
    ) -> tuple[AttentionMetadata, list[torch.Tensor]]: ...
