"""EngineCore.get_metrics: the core's gauges and counters by name (messages.Metrics), read by
LLM.get_metrics, the engine-core process (sent with its outputs) and the server's /metrics
(entrypoints/openai/metrics.py)."""

from __future__ import annotations

from typing import Protocol

from pagedllm.engine.config import SchedulerConfig
from pagedllm.engine.host_tier import HostTierStats
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.messages import Metrics
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.spec_decode import SpecDecodeStats


class MetricsSource(Protocol):
    """What the metrics read of an EngineCore (core.py), named here so that this module does
    not import the core that imports it."""

    config: SchedulerConfig
    kv: KVCacheManager
    scheduler: Scheduler
    num_prompt_tokens: int
    num_generation_tokens: int
    kv_load_seconds: float


def core_metrics(self: MetricsSource) -> Metrics:
    """Gauges and counters by name. The prefix_cache_* counters count each sequence's first
    admission (queries, hits: tokens; the hit rate is theirs); its resumes after preemption
    are counted apart, in prefix_cache_preempted_* (kv_cache_manager.PrefixCacheStats)."""
    kv = self.kv
    stats = kv.prefix_cache_stats
    q, h = stats.queries, stats.hits
    return {
        **_host_tier_metrics(self),
        **_spec_decode_metrics(self),
        "num_kv_blocks": kv.num_blocks,
        "num_free_kv_blocks": kv.num_free_blocks,
        "kv_cache_usage": kv.usage,
        "num_preemptions": self.scheduler.num_preemptions,
        "prefix_cache_requests": stats.requests,
        "prefix_cache_query_tokens": q,
        "prefix_cache_hit_tokens": h,
        "prefix_cache_hit_rate": h / q if q else 0.0,
        "prefix_cache_preempted_requests": stats.preempted_requests,
        "prefix_cache_preempted_query_tokens": stats.preempted_queries,
        "prefix_cache_preempted_hit_tokens": stats.preempted_hits,
        "num_prompt_tokens": self.num_prompt_tokens,
        "num_generation_tokens": self.num_generation_tokens,
        "num_requests_running": len({s.request_id for s in self.scheduler.running}),
        "num_requests_waiting": len(
            {s.request_id for s in self.scheduler.waiting} - {s.request_id for s in self.scheduler.running}
        ),
        "num_prefix_cache_evictions": kv.pool.num_evictions,
        "num_forked_sequences": self.scheduler.num_forked_sequences,
        "num_copy_on_write_blocks": kv.num_copy_on_writes,
        "kv_cache_dtype": self.config.kv_cache_dtype,
        "block_size": self.config.block_size,
        # per KV-cache group: its attention kind, layers and the blocks it holds now
        "kv_cache_groups": [
            {
                "group": g,
                "kind": group.kind,
                "sliding_window": group.sliding_window,
                "num_layers": len(group.layer_ids),
                "num_blocks": held,
            }
            for g, (group, held) in enumerate(zip(kv.groups, kv.num_blocks_by_group(), strict=True))
        ],
    }


def _host_tier_metrics(self: MetricsSource) -> Metrics:
    """The host tier (host_tier.py): its blocks, the hit tokens each tier served (first
    admissions; resumes apart), blocks and bytes moved each way, the preempted sequences'
    wait (preemption to resume, seconds summed) and how many were swapped out."""
    kv, sched = self.kv, self.scheduler
    stats = kv.prefix_cache_stats
    host = kv.host
    moved = host.stats if host is not None else HostTierStats()
    block_bytes = self.config.kv_block_bytes
    return {
        "num_host_kv_blocks": 0 if host is None else host.num_blocks,
        "num_cached_host_kv_blocks": 0 if host is None else host.num_cached_blocks,
        "prefix_cache_gpu_hit_tokens": stats.hits - stats.host_hits,
        "prefix_cache_host_hit_tokens": stats.host_hits,
        "prefix_cache_preempted_host_hit_tokens": stats.preempted_host_hits,
        "num_offloaded_blocks": moved.offloaded_blocks,
        "num_loaded_blocks": moved.loaded_blocks,
        "num_prefetched_blocks": moved.prefetched_blocks,
        "num_swapped_out_blocks": moved.swapped_out_blocks,
        "kv_offload_bytes": moved.offloaded_blocks * block_bytes,
        "kv_load_bytes": moved.loaded_blocks * block_bytes,
        "kv_load_seconds": self.kv_load_seconds,
        "preemption_mode": self.config.preemption_mode,
        "num_swapped_out_sequences": sched.num_swapped_out_sequences,
        "num_resumed_sequences": sched.num_resumed,
        "preempted_wait_seconds": sched.preempted_wait_s,
    }


def _spec_decode_metrics(self: MetricsSource) -> Metrics:
    """Speculative decoding (spec_decode.py), vLLM v1's names: verification rows (`num_drafts`),
    proposals verified and accepted, accepted per proposal position; the acceptance rate
    (accepted / proposed) and the mean acceptance length (tokens a verification row emits: 1 +
    accepted / rows, vLLM's definition). All 0 (and [] per position) when speculation is off."""
    spec = self.scheduler.speculator
    stats = SpecDecodeStats(0) if spec is None else spec.stats
    drafts, proposed, accepted = stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens
    return {
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": proposed,
        "spec_decode_num_accepted_tokens": accepted,
        "spec_decode_num_accepted_tokens_per_pos": list(stats.accepted_per_pos),
        "spec_decode_acceptance_rate": accepted / proposed if proposed else 0.0,
        "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
    }
