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


def test_chat_closed_loop_clients(tmp_path):
    """--concurrency K: K clients, each sending its conversations' turns one at a time; every turn of
    every conversation is answered (output tokens), the tier still hits, and the row names K."""
    out = tmp_path / "rows.jsonl"
    argv = ["bench", "offload", "--device", "cpu", "--num-kv-blocks", "48", "--block-size", "8", "--concurrency", "2"]
    argv += ["--system-prompts", "2", "--system-len", "64", "--conversations", "6", "--turns", "3"]
    argv += ["--turn-len", "16", "--output-len", "4", "--tier-multiples", "0", "2", "--output-json", str(out)]
    assert main(argv) == 0
    off, on = (json.loads(line) for line in out.read_text().splitlines())
    assert off["concurrency"] == on["concurrency"] == 2
    for row in (off, on):
        assert abs(row["output_tok_s"] * row["elapsed_s"] - 6 * 3 * 4) < 1e-6  # 18 answers of 4 tokens
    assert off["host_hit_rate"] == 0 and on["host_hit_rate"] > 0 and on["hit_rate"] > off["hit_rate"]
