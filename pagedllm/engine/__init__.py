"""The control plane: requests, KV-cache manager (block pool), scheduler, engine. No torch here."""

from pagedllm.engine.block_pool import BlockPool, hash_block
from pagedllm.engine.config import SchedulerConfig
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from pagedllm.engine.sequence import Sequence, SequenceStatus

__all__ = [
    "BlockPool",
    "hash_block",
    "SchedulerConfig",
    "KVCacheManager",
    "LLMEngine",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
]
