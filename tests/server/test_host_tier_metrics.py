"""The host tier's gauges and counters on /metrics: blocks, hits from each tier, bytes each way,
load time and the preempted sequences' wait, read from the engine core's metrics."""

from prometheus_client.parser import text_string_to_metric_families

from pagedllm.entrypoints.openai.metrics import ServerMetrics
from tests.engine.test_host_tier import revisiting, run
from tests.server.test_prefix_cache_metrics import MetricsSource


def test_host_tier_metrics_are_exported():
    _, engine, _ = run(revisiting(), host_blocks=64, blocks=24)
    engine.config.kv_block_bytes = 100  # what LLM sets from the runner: bytes = blocks x this
    m = engine.get_metrics()
    assert m["prefix_cache_host_hit_tokens"] > 0 and m["num_loaded_blocks"] > 0
    text, _ = ServerMetrics(MetricsSource(m), "tiny").render()
    samples = {s.name: s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    assert samples["pagedllm:host_kv_cache_blocks"] == 64
    assert samples["pagedllm:host_kv_cache_cached_blocks"] == m["num_cached_host_kv_blocks"] > 0
    assert samples["pagedllm:prefix_cache_host_hits_total"] == m["prefix_cache_host_hit_tokens"]
    assert samples["pagedllm:prefix_cache_gpu_hits_total"] == m["prefix_cache_gpu_hit_tokens"]
    assert samples["pagedllm:kv_load_bytes_total"] == 100 * m["num_loaded_blocks"]
    assert samples["pagedllm:kv_offload_bytes_total"] == 100 * m["num_offloaded_blocks"]
    assert "pagedllm:kv_load_seconds_total" in samples and "pagedllm:preempted_wait_seconds_total" in samples
