"""The Prometheus exposition of the prefix-cache counters: first admissions in
pagedllm:prefix_cache_{queries,hits}_total, resumes after preemption in
pagedllm:prefix_cache_preempted_{queries,hits}_total, read from the engine core's metrics."""

from prometheus_client.parser import text_string_to_metric_families

from pagedllm.entrypoints.openai.metrics import ServerMetrics
from tests.engine.test_engine_equivalence import make_workload
from tests.engine.test_prefix_cache_stats import run_preempting


class MetricsSource:
    """What ServerMetrics reads from AsyncLLM: get_metrics() and the finish callbacks."""

    def __init__(self, metrics):
        self.metrics = metrics
        self.finish_callbacks = []

    def get_metrics(self):
        return self.metrics


def test_preempted_lookups_are_exported_apart():
    engine, _ = run_preempting(make_workload(3, n=10), block_size=4, num_kv_blocks=26)
    m = engine.get_metrics()
    assert m["num_preemptions"] > 0 and m["prefix_cache_preempted_hit_tokens"] > 0
    text, _ = ServerMetrics(MetricsSource(m), "tiny").render()
    samples = {s.name: s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    assert samples["pagedllm:prefix_cache_queries_total"] == m["prefix_cache_query_tokens"] == 293  # the prompts
    assert samples["pagedllm:prefix_cache_hits_total"] == m["prefix_cache_hit_tokens"]
    assert samples["pagedllm:prefix_cache_preempted_queries_total"] == m["prefix_cache_preempted_query_tokens"]
    assert samples["pagedllm:prefix_cache_preempted_hits_total"] == m["prefix_cache_preempted_hit_tokens"]
