"""`pagedllm bench offload` on CPU with the bundled model at a small size: one JSON row per tier
size, and with the tier on the second turns hit the host tier (more hits than with it off)."""

import json

from pagedllm.entrypoints.cli import main


def test_chat_rows_per_tier_size(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    argv = ["bench", "offload", "--device", "cpu", "--num-kv-blocks", "48", "--block-size", "8"]
    argv += ["--system-prompts", "2", "--system-len", "64", "--conversations", "6", "--turns", "3"]
    argv += ["--turn-len", "16", "--output-len", "4", "--tier-multiples", "0", "2", "--output-json", str(out)]
    assert main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    off, on = rows
    assert (off["tier_multiple"], on["tier_multiple"]) == (0, 2)
    assert off["host_hit_rate"] == 0 and on["host_hit_rate"] > 0
    assert on["hit_rate"] > off["hit_rate"] and on["hit_rate"] <= on["ideal_hit_rate"] + 1e-9
    assert on["prefix_over_pool"] > 1 and on["kv_load_bytes"] > 0 and "commit" in on
