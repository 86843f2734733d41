"""Beam search on CUDA (Triton kernels, CUDA graphs, async scheduling, the batched block copy),
float32, against HF transformers' beam search on the CPU. Run with `pytest -m gpu`."""

import pytest

from pagedllm import LLM, BeamSearchParams
from tests.helpers import FAMILIES
from tests.model.test_beam_search import PROMPTS, check, hf_beams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", [dict(), dict(async_scheduling=True), dict(enforce_eager=True)], ids=str)
def test_gpu_beams_equal_hf(tiny_models, family, mode):
    path = tiny_models[family]
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=128, block_size=8, max_num_seqs=16, **mode)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=10))
    check(outs, [hf_beams(path, p, 4, 10) for p in PROMPTS])
    m = llm.get_metrics()
    assert m["num_copy_on_write_blocks"] > 0 and m["num_free_kv_blocks"] == m["num_kv_blocks"]
