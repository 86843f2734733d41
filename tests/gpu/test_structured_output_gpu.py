"""Structured output and the token controls on CUDA (run with `pytest -m gpu`): the grammar mask
and the controls beside the fused Gumbel sampler (temperature > 0 with no top-k / top-p), under
CUDA graphs, eager and async scheduling, in the model's own dtype; and greedy penalties in fp32
equal to the CPU path."""

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams, default_model_path
from pagedllm.engine.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.gpu

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["a", "b", "c"]},
        "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    },
    "required": ["name", "kind", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["def main(", "import os\n", "class A:", "# a list of"]


@pytest.mark.parametrize("mode", ["graphs", "eager", "graphs+async"])
def test_constrained_samples_always_valid_on_cuda(mode):
    llm = LLM(
        default_model_path(),
        device="cuda",
        num_kv_blocks=512,  # a fixed pool: the earlier tests' engines may still hold GPU memory
        enforce_eager=mode == "eager",
        async_scheduling=mode.endswith("async"),
    )
    json_p = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=96, structured_outputs=StructuredOutputsParams(json=SCHEMA))
        for i in range(8)
    ]
    regex_p = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=32,
            structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,8}-\d{2}"),
        )
        for i in range(8)
    ]
    free_p = [SamplingParams(temperature=1.0, seed=i, max_tokens=32, ignore_eos=True) for i in range(8)]
    outs = llm.generate(PROMPTS * 6, json_p + regex_p + free_p, use_tqdm=False)
    for o in outs[:8]:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
    for o in outs[8:16]:
        assert re.fullmatch(r"[a-z]{3,8}-\d{2}", o.outputs[0].text), o.outputs[0].text
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs[16:])  # unconstrained rows beside them


def test_controls_on_the_fused_sampler_path():
    llm = LLM(default_model_path(), device="cuda", num_kv_blocks=512)
    allowed = [5, 17, 99, 1000]
    outs = llm.generate(
        PROMPTS,
        [
            SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)
            for i in range(4)
        ],
        use_tqdm=False,
    )
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs)
    banned = {t for o in outs for t in o.outputs[0].token_ids}
    bias = {t: -100.0 for t in banned}
    again = llm.generate(
        PROMPTS,
        [
            SamplingParams(
                temperature=1.0,
                seed=i,
                max_tokens=24,
                ignore_eos=True,
                allowed_token_ids=allowed + [7],
                logit_bias=bias,
            )
            for i in range(4)
        ],
        use_tqdm=False,
    )
    assert all(set(o.outputs[0].token_ids) <= (set(allowed) | {7}) - banned for o in again)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_penalties_fp32_cuda_equal_cpu(async_scheduling):
    params = [
        SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=40, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0, max_tokens=40, logit_bias={10: 5.0}),
    ]
    cpu = LLM(default_model_path(), device="cpu")
    gpu = LLM(
        default_model_path(), device="cuda", dtype="float32", num_kv_blocks=512, async_scheduling=async_scheduling
    )
    want = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
