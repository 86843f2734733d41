"""/metrics exposes speculative decoding's counters under vLLM v1's names (pagedllm: prefix)."""

from prometheus_client import CollectorRegistry, generate_latest

from pagedllm.entrypoints.openai.metrics import _EngineCollector


def test_spec_decode_counters_are_exposed():
    m = {
        "spec_decode_num_drafts": 7,
        "spec_decode_num_draft_tokens": 20,
        "spec_decode_num_accepted_tokens": 11,
        "spec_decode_num_accepted_tokens_per_pos": [6, 4, 1],
    }
    registry = CollectorRegistry()
    registry.register(_EngineCollector(lambda: m, "tiny"))
    text = generate_latest(registry).decode()
    assert 'pagedllm:spec_decode_num_drafts_total{model_name="tiny"} 7.0' in text
    assert 'pagedllm:spec_decode_num_draft_tokens_total{model_name="tiny"} 20.0' in text
    assert 'pagedllm:spec_decode_num_accepted_tokens_total{model_name="tiny"} 11.0' in text
    for pos, n in enumerate([6, 4, 1]):
        assert (
            f'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{pos}"}} {n}.0'
            in text
        )
