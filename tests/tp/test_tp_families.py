"""TP=2 (two processes, gloo) on the windowed families, past their window: Phi-3, whose checkpoint
packs q/k/v and gate/up (each rank cuts its heads and its half of the MLP out of the packed
tensors; one sliding-window KV-cache group), and Gemma 3 (a full-attention and a sliding-window
group). The tokens are HF's."""

import pytest

from pagedllm import LLM, SamplingParams
from tests.model.families import family_checkpoints, long_workload
from tests.model.hf_reference import GREEDY, hf_position_logits


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    return family_checkpoints(tiny_models["qwen3"], tmp_path_factory)


@pytest.mark.parametrize("kind", ["phi3", "gemma3"])
def test_windowed_families_under_tp2_give_hf_tokens(checkpoints, kind):
    path = checkpoints[kind]
    prompts, max_tokens = long_workload(3)
    with LLM(path, tensor_parallel_size=2, num_kv_blocks=48, block_size=8, max_model_len=256) as llm:
        outs = llm.generate(prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens], use_tqdm=False)
        assert len(llm.get_metrics()["kv_cache_groups"]) == (1 if kind == "phi3" else 2)
    for prompt, out in zip(prompts, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        ids = prompt + got
        hf_greedy = hf_position_logits(path, ids)[len(prompt) - 1 : len(ids) - 1].argmax(-1)  # HF's pick after each
        assert got == hf_greedy.tolist()
