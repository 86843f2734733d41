"""Prometheus metrics for the server, named like vLLM's with the `pagedllm:` prefix.

Gauges and counters are read at scrape time from the metrics dict that the engine core sends
with its outputs (at most ~20 ms old while busy, fresh when it goes idle), so scraping never
touches the engine; the latency histograms are observed on the event loop when a request's
final output arrives, from the core's timestamps (arrival, first token, finish: one monotonic
clock across processes). Each server has its own CollectorRegistry.

With several API processes (`--api-server-count N`, api_processes.py) the request metrics of all
of them are added up through prometheus_client's multiprocess mode: each process writes its
histograms and counters to files under $PROMETHEUS_MULTIPROC_DIR and a scrape of any process
reads them all; the engine's gauges and counters come from the core, the same in every process.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedllm.engine.outputs import RequestOutput

# (name, help, key in AsyncLLM.get_metrics(), scale)
GAUGES = [
    ("pagedllm:num_requests_running", "Number of requests in the running batch.", "num_requests_running", 1),
    ("pagedllm:num_requests_waiting", "Number of requests waiting to run.", "num_requests_waiting", 1),
    ("pagedllm:kv_cache_usage_perc", "KV-cache usage: fraction of blocks in use (1 = full).", "kv_cache_usage", 1),
    # the host tier of the prefix cache (docs/features/host-kv-tier.md)
    ("pagedllm:host_kv_cache_blocks", "Blocks of the host KV tier (0: no tier).", "num_host_kv_blocks", 1),
    (
        "pagedllm:host_kv_cache_cached_blocks",
        "Blocks of the host KV tier that hold a cached prefix block.",
        "num_cached_host_kv_blocks",
        1,
    ),
]
COUNTERS = [  # exposed with the _total suffix
    # first admissions only; a preempted request's lookups on resume are the preempted_ pair
    ("pagedllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_query_tokens"),
    ("pagedllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hit_tokens"),
    (
        "pagedllm:prefix_cache_preempted_queries",
        "Tokens looked up in the prefix cache by preempted requests on resume.",
        "prefix_cache_preempted_query_tokens",
    ),
    (
        "pagedllm:prefix_cache_preempted_hits",
        "Tokens found in the prefix cache by preempted requests on resume.",
        "prefix_cache_preempted_hit_tokens",
    ),
    (
        "pagedllm:prefix_cache_gpu_hits",
        "Prompt tokens found in the GPU pool of the prefix cache.",
        "prefix_cache_gpu_hit_tokens",
    ),
    (
        "pagedllm:prefix_cache_host_hits",
        "Prompt tokens found in the host KV tier and loaded back.",
        "prefix_cache_host_hit_tokens",
    ),
    ("pagedllm:kv_offload_bytes", "KV bytes copied from the GPU pool to the host tier.", "kv_offload_bytes"),
    ("pagedllm:kv_load_bytes", "KV bytes copied from the host tier to the GPU pool.", "kv_load_bytes"),
    ("pagedllm:kv_load_seconds", "Device time spent loading KV from the host tier.", "kv_load_seconds"),
    (
        "pagedllm:kv_prefetched_blocks",
        "KV blocks loaded from the host tier a step ahead, beside the previous step's forward.",
        "num_prefetched_blocks",
    ),
    ("pagedllm:num_preemptions", "Sequences preempted (by recompute or swap).", "num_preemptions"),
    (
        "pagedllm:preempted_wait_seconds",
        "Time preempted sequences waited from preemption to resume.",
        "preempted_wait_seconds",
    ),
    ("pagedllm:prompt_tokens", "Prompt tokens processed (prefilled).", "num_prompt_tokens"),
    ("pagedllm:generation_tokens", "Tokens generated.", "num_generation_tokens"),
    # parallel sampling: children forked from a request's first sequence, and the blocks copied
    # because a sequence wrote into a partial block it shared (copy-on-write)
    ("pagedllm:forked_sequences", "Sequences forked by parallel sampling (n, best_of).", "num_forked_sequences"),
    (
        "pagedllm:copy_on_write_blocks",
        "KV blocks copied before a write into a shared block (copy-on-write).",
        "num_copy_on_write_blocks",
    ),
    # speculative decoding (docs/features/speculative-decoding.md): vLLM v1's spec_decode_* counters
    (
        "pagedllm:spec_decode_num_drafts",
        "Verification rows: sequences verified with proposals.",
        "spec_decode_num_drafts",
    ),
    ("pagedllm:spec_decode_num_draft_tokens", "Proposed tokens verified.", "spec_decode_num_draft_tokens"),
    ("pagedllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", "spec_decode_num_accepted_tokens"),
]
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
TPOT_BUCKETS = [
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
E2E_BUCKETS = [
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]


class _EngineCollector(Collector):
    def __init__(self, get_metrics, model_name: str):
        self.get_metrics = get_metrics
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        m = self.get_metrics()
        for name, doc, key, scale in GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(m.get(key, 0)) * scale)
            yield g
        for name, doc, key in COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(m.get(key, 0)))
            yield c
        # the KV cache's configuration as labels of a constant 1, as vLLM's vllm:cache_config_info
        info = GaugeMetricFamily(
            "pagedllm:cache_config_info",
            "KV cache configuration (labels); the value is always 1.",
            labels=["model_name", "kv_cache_dtype", "block_size", "num_gpu_blocks"],
        )
        info.add_metric(
            [
                self.model_name,
                str(m.get("kv_cache_dtype", "")),
                str(m.get("block_size", "")),
                str(m.get("num_kv_blocks", "")),
            ],
            1.0,
        )
        yield info
        # blocks each KV-cache group holds (engine/kv_cache_groups.py): a window's stays bounded
        groups = GaugeMetricFamily(
            "pagedllm:kv_cache_group_blocks",
            "KV blocks held by each KV-cache group (layers of one attention kind).",
            labels=["model_name", "group", "kind", "sliding_window"],
        )
        for g in m.get("kv_cache_groups", []):
            window = "" if g["sliding_window"] is None else str(g["sliding_window"])
            groups.add_metric([self.model_name, str(g["group"]), g["kind"], window], float(g["num_blocks"]))
        yield groups
        # accepted proposals by their position in the proposal (vLLM's labelled counter)
        per_pos = CounterMetricFamily(
            "pagedllm:spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by position in the proposal (0 = the first).",
            labels=["model_name", "position"],
        )
        for pos, n in enumerate(m.get("spec_decode_num_accepted_tokens_per_pos", [])):
            per_pos.add_metric([self.model_name, str(pos)], float(n))
        yield per_pos


class ServerMetrics:
    def __init__(self, async_llm, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(async_llm.get_metrics, model_name))
        shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        own: CollectorRegistry | None = self.registry
        if shared:  # every API process's files, read at each scrape; this process's values live there too
            from prometheus_client.multiprocess import MultiProcessCollector

            MultiProcessCollector(self.registry, path=shared)
            own = None
        labels = ["model_name"]
        self.ttft = Histogram(
            "pagedllm:time_to_first_token_seconds",
            "Time from arrival to the first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=own,
        ).labels(model_name)
        self.tpot = Histogram(
            "pagedllm:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            labels,
            buckets=TPOT_BUCKETS,
            registry=own,
        ).labels(model_name)
        self.e2e = Histogram(
            "pagedllm:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            labels,
            buckets=E2E_BUCKETS,
            registry=own,
        ).labels(model_name)
        self.finished = Counter(
            "pagedllm:request_success",
            "Finished requests by finish reason (stop, length, abort, error).",
            ["model_name", "finished_reason"],
            registry=own,
        )
        self.model_name = model_name
        async_llm.finish_callbacks.append(self.observe_finished)

    def observe_finished(self, out: RequestOutput) -> None:
        """One count per request (n > 1 included: "abort" when any of its sequences was), its
        finish reason the first choice's. TPOT is over the request's longest returned sequence:
        its samples decode side by side, one token per step each."""
        reasons = [o.finish_reason for o in out.outputs]
        reason = "abort" if not reasons or "abort" in reasons else reasons[0]
        self.finished.labels(self.model_name, reason or "abort").inc()
        m = out.metrics
        if m is None or reason == "abort" or m.first_token_time is None:
            return
        self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.finish_time is not None:
            self.e2e.observe(max(0.0, m.finish_time - m.arrival_time))
            num_tokens = max(len(o.token_ids) for o in out.outputs)
            if num_tokens > 1:  # the first token's time is TTFT's
                self.tpot.observe(max(0.0, (m.finish_time - m.first_token_time) / (num_tokens - 1)))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
