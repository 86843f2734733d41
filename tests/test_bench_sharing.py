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
        # one contiguous copy per sample (the beam mode's "without sharing"), computed on the shared run,
        # is what the n separate requests really held, step by step
        assert with_["mean_contiguous_blocks"] == without["mean_blocks"] == without["mean_contiguous_blocks"]
        assert with_["peak_contiguous_blocks"] == without["peak_blocks"]
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
    assert b["with_sharing"]["mean_contiguous_blocks"] == b["without_sharing"]["mean_blocks"]


def test_bench_sharing_beam_mode(tmp_path, capsys):
    table, doc = run_bench(tmp_path, capsys, "--mode", "beam", "--n", "1", "2", "4")
    assert doc["parameters"]["mode"] == "beam"
    rows = {(r["dataset"], r["beam_width"]): r for r in doc["rows"]}
    assert set(rows) == {(d, w) for d in ("alpaca", "sharegpt") for w in (1, 2, 4)}
    for (_dataset, width), r in rows.items():
        run = r["run"]
        assert run["prompt_tokens_computed"] == r["prompt_tokens"]  # each prompt prefilled once for its W beams
        assert run["pool_equals_block_tables"]  # the pool holds exactly the live beams' blocks
        assert run["forked_sequences"] >= (width - 1) * 12
        if width == 1:  # one beam: nothing to share
            assert r["time_avg_saving_pct"] == r["peak_saving_pct"] == 0.0
        else:  # the beams share at least their prompt, and at best all but one beam's blocks
            assert 0 < r["time_avg_saving_pct"] <= 100 * (1 - 1 / width)
            assert r["peak_blocks_with"] <= r["peak_blocks_without"]
    assert "sharegpt   4" in table and "37.6-55.2%" in table and "44.3-66.3%" in table and "(W=2-6)" in table


def test_beam_mode_is_deterministic(tmp_path, capsys):
    args = ("--mode", "beam", "--n", "3", "--datasets", "sharegpt")
    runs = [run_bench(tmp_path, capsys, *args)[1]["rows"][0] for _ in range(2)]
    for r in runs:
        del r["run"]["seconds"]
    assert runs[0] == runs[1]


def test_bench_sharing_refuses_independent_lengths_for_beams(capsys):
    assert cli.main(["bench", "sharing", "--mode", "beam", "--sample-lengths", "independent"]) == 1
    assert "--sample-lengths independent is for --mode parallel" in capsys.readouterr().err


def test_bench_sharing_needs_no_torch():
    for mode in ("parallel", "beam"):
        code = (
            "import sys; from pagedllm.entrypoints import cli;"
            f"rc = cli.main(['bench', 'sharing', '--mode', '{mode}', '--num-requests', '3', '--n', '2',"
            " '--datasets', 'alpaca']);"
            "assert rc == 0 and 'torch' not in sys.modules, rc"
        )
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=300)
