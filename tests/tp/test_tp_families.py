"""TP=2 (two processes, gloo) on Phi-3, whose checkpoint packs q/k/v and gate/up: each rank cuts
its heads and its half of the MLP out of the packed tensors, and the tokens are HF's."""

import pytest

from pagedllm import LLM, SamplingParams
from tests.model.families import WINDOW, family_checkpoints, short_workload
from tests.model.hf_reference import GREEDY, hf_position_logits


@pytest.fixture(scope="module")
def phi3(tiny_models, tmp_path_factory):
    return family_checkpoints(tiny_models["qwen3"], tmp_path_factory)["phi3"]


def test_phi3_packed_checkpoint_under_tp2_gives_hf_tokens(phi3):
    prompts, max_tokens = short_workload(3)
    with LLM(phi3, tensor_parallel_size=2, num_kv_blocks=16, block_size=8, max_model_len=WINDOW) as llm:
        outs = llm.generate(prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens], use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        ids = prompt + got
        hf_greedy = hf_position_logits(phi3, ids)[len(prompt) - 1 : len(ids) - 1].argmax(-1)  # HF's pick after each
        assert got == hf_greedy.tolist()
