"""TP=2 (two processes, gloo) on the mixture-of-experts families: each rank holds half of every
expert's intermediate dimension and the experts' partial sums are all-reduced once. The greedy
tokens are TP=1's and HF's; an experts' size that TP does not divide fails at start-up."""

import pytest

from pagedllm import LLM, SamplingParams
from tests.model.families import long_workload
from tests.model.hf_reference import GREEDY, hf_position_logits
from tests.model.test_families import edited
from tests.model.test_moe import moe_checkpoints


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    return moe_checkpoints(tiny_models["qwen3"], tmp_path_factory)


def test_moe_under_tp2_gives_tp1_and_hf_tokens(checkpoints):
    """Qwen3-MoE with a dense layer between two sparse ones (Mixtral's experts load and slice the
    same way: tests/model/test_moe.py checks its checkpoint names)."""
    path = checkpoints["qwen3moe_top2"]
    prompts, max_tokens = long_workload(3)
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    settings = dict(num_kv_blocks=48, block_size=8, max_model_len=256)
    with LLM(path, tensor_parallel_size=2, **settings) as llm:
        tp2 = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, **settings) as llm:
        tp1 = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tp2 == tp1
    for prompt, got in zip(prompts, tp2, strict=True):
        ids = prompt + got
        assert got == hf_position_logits(path, ids)[len(prompt) - 1 : len(ids) - 1].argmax(-1).tolist()


def test_expert_size_not_divisible_by_tp_fails_at_start_up(checkpoints, tmp_path):
    path = edited(checkpoints["qwen3moe_top2"], tmp_path, moe_intermediate_size=33)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2 must divide the experts' moe_intermediate_size \(33\)"
    ):
        LLM(path, tensor_parallel_size=2, num_kv_blocks=8)
