"""`pagedllm bench sharing`: a small run through the CLI (no torch, no model)."""

import json
import subprocess
import sys

from pagedllm.entrypoints import cli


def run_bench(tmp_path, capsys, *extra):
    out = tmp_path / "sharing.json"
    args = ["bench", "sharing", "--num-requests", "12", "--concurrency", "4", "--output-json", str(out), *extra]
    assert cli.main(args) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_bench_sharing_table_and_json(tmp_path, capsys):
    table, doc = run_bench(tmp_path, capsys, "--n", "1", "3")
    assert doc["benchmark"] == "sharing" and {"commit", "date", "machine", "parameters"} <= set(doc)
    assert doc["parameters"]["block_size"] == 16 and doc["parameters"]["num_requests"] == 12
    rows = {(r["dataset"], r["n"]): r for r in doc["rows"]}
    assert set(rows) == {(d, n) for d in ("alpaca", "sharegpt") for n in (1, 3)}
    for (_dataset, n), r in rows.items():
        with_, without = r["with_sharing"], r["without_sharing"]
        assert with_["steps"] == without["steps"]  # the same timeline, so the averages compare
        assert without["prompt_tokens_computed"] == n * with_["prompt_tokens_computed"]  # prompt once vs n times
        assert with_["forked_sequences"] == (n - 1) * 12 and without["forked_sequences"] == 0
        if n == 1:  # nothing to share: the two runs hold the same blocks
            assert r["time_avg_saving_pct"] == r["peak_saving_pct"] == 0.0
        else:
            assert r["time_avg_blocks_with"] < r["time_avg_blocks_without"] and r["time_avg_saving_pct"] > 0
            assert r["peak_blocks_with"] <= r["peak_blocks_without"]
    assert "sharegpt   3" in table and "16.2-30.5%" in table and "6.1-9.8%" in table


def test_independent_sample_lengths_end_samples_apart(tmp_path, capsys):
    _, same = run_bench(tmp_path, capsys, "--n", "4", "--datasets", "sharegpt")
    _, independent = run_bench(
        tmp_path, capsys, "--n", "4", "--datasets", "sharegpt", "--sample-lengths", "independent"
    )
    a, b = same["rows"][0], independent["rows"][0]
    assert a["mean_prompt_len"] == b["mean_prompt_len"]  # the same requests, other output lengths
    assert a["with_sharing"]["generated_tokens"] != b["with_sharing"]["generated_tokens"]


def test_bench_sharing_needs_no_torch():
    code = (
        "import sys; from pagedllm.entrypoints import cli;"
        "rc = cli.main(['bench', 'sharing', '--num-requests', '3', '--n', '2', '--datasets', 'alpaca']);"
        "assert rc == 0 and 'torch' not in sys.modules, rc"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=60)
