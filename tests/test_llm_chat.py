"""LLM.chat (vLLM's): conversations rendered by the chat template (the tokenizer's or one given),
tools offered to it, control tokens only where the template writes them, then generated."""

from __future__ import annotations

import pytest

import pagedllm
from pagedllm import SamplingParams
from pagedllm.engine.errors import InvalidRequestError
from pagedllm.entrypoints.llm import LLM

GREEDY = SamplingParams(temperature=0, max_tokens=4)
HI = [{"role": "user", "content": "hello there"}]
TOOLS_TEMPLATE = (
    "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def llm():
    with LLM(pagedllm.default_model_path(), device="cpu", num_kv_blocks=32, max_model_len=512) as llm:
        yield llm


def test_chat_is_generate_on_the_rendered_prompt(llm):
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(HI, add_generation_prompt=True, tokenize=False)
    (out,) = llm.chat(HI, GREEDY)
    assert out.prompt == rendered
    assert out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert out.outputs[0].token_ids == llm.generate([rendered], GREEDY)[0].outputs[0].token_ids
    two = llm.chat([HI, [{"role": "user", "content": "bye"}]], GREEDY, use_tqdm=False)  # a list of conversations
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_chat_options_reach_the_template(llm):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    (out,) = llm.chat(HI, GREEDY, chat_template=TOOLS_TEMPLATE, tools=tools)
    assert out.prompt.startswith("[tool get_weather]<|im_start|>user")
    (bare,) = llm.chat(HI, GREEDY, add_generation_prompt=False)
    assert not bare.prompt.endswith("assistant\n")
    cont = [*HI, {"role": "assistant", "content": "General"}]
    (out,) = llm.chat(cont, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt.endswith("<|im_start|>assistant\nGeneral")  # the turn is left open
    (out,) = llm.chat(
        HI, GREEDY, chat_template="{{ greeting }}{{ messages[0].content }}", chat_template_kwargs={"greeting": "Hi: "}
    )
    assert out.prompt == "Hi: hello there"


def test_typed_control_tokens_stay_text_and_mistakes_name_the_field(llm):
    tok = llm.get_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    (out,) = llm.chat([{"role": "user", "content": "a<|im_end|>b"}], GREEDY)
    assert out.prompt_token_ids.count(end) == 1 and "a<|im_end|>b" in out.prompt
    for kwargs, param in (
        ({"continue_final_message": True}, "continue_final_message"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            llm.chat(HI, GREEDY, **kwargs)
        assert e.value.param == param
    with pytest.raises(InvalidRequestError) as e:
        llm.chat([{"role": "wizard", "content": "x"}], GREEDY)
    assert e.value.param == "messages[0].role"
