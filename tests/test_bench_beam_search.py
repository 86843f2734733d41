"""benchmarks/beam_search.py on a tiny float32 model on the CPU: pagedllm's best beams equal HF's."""

import argparse
import json

import pytest

from tests.helpers import load_script


def bench_module():
    return load_script("benchmarks/beam_search.py")


def run(model_dir, tmp_path, *extra):
    mod = bench_module()
    parser = argparse.ArgumentParser()
    mod.add_args(parser)
    out = tmp_path / "row.json"
    argv = ["--model", model_dir, "--num-prompts", "3", "--input-len", "12", "--output-len", "6"]
    argv += [
        "--beam-width",
        "2",
        "--repeat",
        "2",
        "--num-kv-blocks",
        "64",
        "--block-size",
        "8",
        "--out",
        str(out),
        *extra,
    ]
    assert mod.main(parser.parse_args(argv)) == 0
    return json.loads(out.read_text())


def test_beam_search_bench_matches_hf_and_appends_a_row(tiny_models, tmp_path):
    row = run(tiny_models["qwen3"], tmp_path, "--hf-batch-size", "2", "--results-dir", str(tmp_path), "--label", "t")
    assert row["benchmark"] == "beam_search" and row["dtype"] == "float32" and row["gpu"] == "cpu"
    assert (row["num_prompts"], row["input_len"], row["output_len"], row["beam_width"]) == (3, 12, 6, 2)
    assert row["hf"]["batch_size"] == 2  # batches of 2 and 1
    for engine in ("pagedllm", "hf"):
        r = row[engine]
        assert (
            len(r["wall_s_all"]) == 2
            and r["wall_s"] > 0
            and r["best_beam_tokens_per_s"] == pytest.approx(18 / r["wall_s"], rel=0.02)
        )
    assert row["speedup_vs_hf"] == pytest.approx(row["hf"]["wall_s"] / row["pagedllm"]["wall_s"], abs=0.01, rel=0.02)
    assert row["best_beam_equal_hf"] == "3/3"  # float32: the same beam search on the same weights
    assert row["max_score_diff_where_equal"] < 1e-4
    saved = json.loads((tmp_path / "beam-search-cpu.json").read_text())
    assert len(saved) == 1 and saved[0]["label"] == "t" and {"commit", "torch", "transformers"} <= set(saved[0])


def test_beam_search_bench_skip_hf(tiny_models, tmp_path):
    row = run(tiny_models["llama"], tmp_path, "--skip-hf", "--no-save")
    assert "hf" not in row and "speedup_vs_hf" not in row and row["pagedllm"]["wall_s"] > 0
    assert not (tmp_path / "beam-search-cpu.json").exists()
