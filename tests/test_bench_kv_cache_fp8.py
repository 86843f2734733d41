"""benchmarks/kv_cache_fp8.py: a tiny accuracy run on the bundled model (CPU), the helpers it
rests on, and (GPU) the capacity mode on a tiny model with a fixed pool."""

import argparse
import json
import math

import pytest

from tests.helpers import load_script


def bench_module():
    return load_script("benchmarks/kv_cache_fp8.py")


def run(tmp_path, argv):
    mod = bench_module()
    parser = argparse.ArgumentParser()
    mod.add_args(parser)
    out = tmp_path / "row.json"
    assert mod.main(parser.parse_args([*argv, "--results-dir", str(tmp_path / "results"), "--out", str(out)])) == 0
    return json.loads(out.read_text())


def test_accuracy_smoke_on_the_bundled_model(tmp_path):
    argv = ["--max-files", "1", "--ppl-tokens", "256", "--prompts", "2", "--new-tokens", "4", "--no-save"]
    argv += ["--kv-dtypes", "fp8_e5m2"]  # one format against auto: the suite's time
    row = run(tmp_path, ["accuracy", *argv])
    assert not (tmp_path / "results").exists()  # --no-save
    assert row["mode"] == "accuracy" and row["device"] == "cpu" and row["dtype"] == "float32"
    assert len(row["files_used"]) == 1 and row["files_used"][0] not in row["files_missing"]
    runs = row["runs"]
    assert list(runs) == ["auto", "fp8_e5m2"]
    auto = runs["auto"]
    assert auto["scales"] is None and auto["perplexity_rel_diff_vs_auto"] == 0
    assert auto["greedy_identical_share"] == 1 and auto["greedy_mean_leading_agree"] == 4
    for kv, r in runs.items():
        assert r["tokens_scored"] == 255  # every token after the first of a 256-token prompt
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1
        assert r["perplexity"] == pytest.approx(math.exp(r["nll"] / r["tokens_scored"]))
        assert 0 <= r["greedy_identical_share"] <= 1 and 0 <= r["greedy_mean_leading_agree"] <= 4
        assert r["num_preemptions"] == 0 and r["kv_cache_dtype"] == ("float32" if kv == "auto" else kv)
        if kv != "auto":
            assert r["block_bytes"] * 4 == auto["block_bytes"]  # one byte per element vs float32
            s = r["scales"]
            assert s["num_layers"] == 6 and 0 < s["k_scale_min"] <= s["k_scale_max"] and s["v_scale_min"] > 0
            assert abs(r["perplexity_rel_diff_vs_auto"]) < 0.05 and r["mean_abs_logprob_diff_vs_auto"] > 0


def test_greedy_windows_spread_over_files_and_never_cross_an_end():
    mod = bench_module()
    files = [list(range(0, 40)), list(range(100, 140)), list(range(200, 240))]
    w = mod.greedy_windows(files, 6, 8)
    assert len(w) == 6 and all(len(x) == 8 for x in w)
    assert all(x == list(range(x[0], x[0] + 8)) for x in w)  # contiguous: inside one file
    assert sorted(x[0] // 100 for x in w) == [0, 0, 1, 1, 2, 2]  # two from each equal file
    with pytest.raises(ValueError):
        mod.greedy_windows([list(range(10))], 4, 8)  # 3 starts for 4 windows
    assert mod.leading_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2 and mod.leading_agreement([1], [1]) == 1
    assert mod.blocks_needed([[0] * 16, [0] * 17], 1, 16) == 2 + 2


def test_kv_cache_dtype_flag_and_capacity_on_cpu_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="kv-dtypes"):
        run(tmp_path, ["accuracy", "--kv-cache-dtype", "fp8", "--no-save"])
    with pytest.raises(SystemExit, match="CUDA"):
        run(tmp_path, ["capacity", "--device", "cpu", "--no-save"])


@pytest.mark.gpu
def test_capacity_fixed_pool_holds_a_byte_per_element_with_fp8(tiny_models, tmp_path):
    argv = ["capacity", "--model", tiny_models["qwen3"], "--kv-cache-memory-bytes", "2MiB", "--max-model-len", "64"]
    row = run(tmp_path, [*argv, "--seq-len", "64", "--verify", "--verify-output-len", "8", "--label", "t"])
    auto, fp8 = row["runs"]["auto"], row["runs"]["fp8"]
    elem = auto["block_bytes"] // fp8["block_bytes"]  # the model's dtype: 4 (float32) or 2 bytes, fp8 1
    assert fp8["kv_cache_dtype"] == "fp8_e4m3" and elem in (2, 4) and fp8["block_bytes"] * elem == auto["block_bytes"]
    for r in (auto, fp8):
        assert r["sequences"] == r["num_kv_blocks"] * r["block_size"] // 64 > 0
        v = r["verify"]
        assert v["ok"] and v["finished"] == v["requests"] == r["sequences"] and v["num_preemptions"] == 0
    assert fp8["num_kv_blocks"] >= elem * auto["num_kv_blocks"] and fp8["sequences"] >= elem * auto["sequences"]
    saved = json.loads(next((tmp_path / "results").glob("kv-fp8-capacity-*.json")).read_text())
    assert len(saved) == 1 and saved[0]["label"] == "t" and {"commit", "torch", "gpu"} <= set(saved[0])
