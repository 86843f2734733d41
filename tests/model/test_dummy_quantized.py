"""load_format="dummy" for a quantized checkpoint's config (tools/make_random_model.py --config-only
--quantize F): the layers are built in the format and filled on the device with bytes of the format
(e4m3 weights with their scales, packed 4-bit weights with scales and zero points), nothing is read
from disk, and the engine runs; the benchmarks of shapes too large to write (Qwen3-32B) use it."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.helpers import load_script

FORMATS = ("fp8-block", "fp8-channel", "awq", "gptq")


def config_only(tmp_path, fmt: str | None, shape: str) -> str:
    out = str(tmp_path / f"{shape}-{fmt or 'plain'}")
    argv = ["--out", out, "--shape", shape, "--config-only", "--device", "cpu"]
    load_script("tools/make_random_model.py").main(argv + (["--quantize", fmt, "--quant-block", "32"] if fmt else []))
    return out


@pytest.mark.parametrize("shape", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dummy_weights_in_each_quantized_format(tmp_path, fmt, shape):
    path = config_only(tmp_path, fmt, shape)
    with open(os.path.join(path, "config.json")) as f:
        assert "quantization_config" in json.load(f)
    assert not [f for f in os.listdir(path) if f.endswith(".safetensors")]
    plain = config_only(tmp_path, None, shape)
    outs = []
    for _ in range(2):  # seeded: the same bytes, the same tokens
        with LLM(path, load_format="dummy", seed=3, num_kv_blocks=32, max_model_len=128) as llm:
            o = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
            outs.append(o[0].outputs[0].token_ids)
            quantized_bytes = llm.runner.weights_bytes
            params = dict(llm.runner.model.named_parameters())
    assert outs[0] == outs[1] and len(outs[0]) == 6
    with LLM(plain, load_format="dummy", seed=3, num_kv_blocks=32, max_model_len=128) as llm:
        assert quantized_bytes < llm.runner.weights_bytes
    if fmt.startswith("fp8"):
        fp8 = [p for n, p in params.items() if p.dtype == torch.float8_e4m3fn]
        assert fp8 and all(p.float().abs().max() > 0 for p in fp8)
        scales = [p for n, p in params.items() if n.endswith("weight_scale")]  # experts: w13_weight_scale
        assert len(scales) == len(fp8) and all(torch.all(s == 0.02) for s in scales)
    else:
        packed = [p for n, p in params.items() if n.endswith("qweight")]
        assert packed and all(p.dtype == torch.int32 and bool((p != 0).any()) for p in packed)
        assert all(torch.all(p == 8) for n, p in params.items() if n.endswith("qzeros"))
