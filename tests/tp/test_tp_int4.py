"""4-bit checkpoints under TP=2 (two processes, gloo): column-parallel layers split the packed weight's
N, row-parallel ones its K in whole groups (desc_act: those stay dequantized at load); the greedy tokens
are HF's over the weights the checkpoint means. (A shard that would cut a group is refused at start-up:
tests/model/test_int4_layer.py; the tiny models' inputs, 64 and 128 columns, cannot show one at TP=2.)"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.model.test_fp8_checkpoints import reference_greedy, write
from tests.model.test_int4_checkpoints import reference_model

# 4-bit under TP=2 against HF: about 14 s on 2 cores, run after the README command (.ci/run)
pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 14, 22, 31, 40, 7], [100 + i for i in range(19)]]


@pytest.mark.parametrize("fmt,flags", [("awq", []), ("gptq", ["--sym", "--desc-act"])])
def test_int4_under_tp2_gives_hf_tokens(tiny_models, tmp_path, fmt, flags):
    src = tiny_models["qwen3"]
    ckpt = write(src, str(tmp_path / fmt), "--format", fmt, "--group-size", "32", *flags)
    ref = reference_model(src, ckpt, fmt)
    with LLM(ckpt, dtype="float32", tensor_parallel_size=2, num_kv_blocks=64, block_size=8) as llm:
        attn = llm.runner.driver.model.model.layers[0].self_attn  # rank 0's shard
        assert attn.qkv_proj.int4 is not None and (attn.o_proj.int4 is None) == ("--desc-act" in flags)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
    for p, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == reference_greedy(ref, p, 8)
