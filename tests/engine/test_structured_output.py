"""Structured output through the real engine on the bundled model: every sampled output matches its
JSON schema / regex / choices / grammar, also with n > 1, async scheduling, preemption and
streaming; grammars that cannot compile are refused naming the field; compiled grammars are cached."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams, default_model_path
from pagedllm.engine import LLMEngine, SchedulerConfig
from pagedllm.engine.errors import InvalidRequestError
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.engine.sampling_params import StructuredOutputsParams as SO

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "pos": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "tags", "pos"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}@[a-z]{3}\.(com|org)"
CHOICES = ["yes", "no", "maybe so"]
LARK = 'start: "(" num (OP num)* ")"\nnum: /[0-9]{1,2}/\nOP: "+" | "*"'
LARK_RE = r"\([0-9]{1,2}([+*][0-9]{1,2})*\)"
GBNF = 'root ::= "<" [a-c] [a-c]? [a-c]? ">"'  # llama.cpp's syntax: converted to Lark
MAX_TOKENS = 80
PROMPT = "def main():"


def valid(text: str, so: SO) -> bool:
    if so.json is not None:
        jsonschema.validate(json.loads(text), so.json if isinstance(so.json, dict) else json.loads(so.json))
        return True
    if so.json_object:
        return isinstance(json.loads(text), dict)
    if so.regex is not None:
        return re.fullmatch(so.regex, text) is not None
    if so.choice is not None:
        return text in so.choice
    return re.fullmatch(LARK_RE if so.grammar == LARK else r"<[a-c]{1,3}>", text) is not None


CASES = {
    "json_schema": SO(json=SCHEMA),
    "json_text": SO(json=json.dumps(SCHEMA["properties"]["pos"])),  # the schema as JSON text
    "json_object": SO(json_object=True),
    "regex": SO(regex=REGEX),
    "choice": SO(choice=CHOICES),
    "lark": SO(grammar=LARK),
    "gbnf": SO(grammar=GBNF),
}


@pytest.fixture(scope="module")
def llm():
    with LLM(default_model_path(), device="cpu", num_kv_blocks=96, block_size=8, max_model_len=256) as llm:
        yield llm


def engine_over(llm: LLM, *, async_scheduling: bool, num_kv_blocks: int, tokenizer: bool = True) -> LLMEngine:
    """Another engine over the fixture's runner (a smaller share of its KV pool)."""
    cfg = SchedulerConfig(num_kv_blocks=num_kv_blocks, block_size=8, max_num_seqs=16, max_model_len=256)
    return LLMEngine(
        cfg,
        llm.runner,
        llm.tokenizer if tokenizer else None,
        llm.engine.scheduler.eos_token_ids,
        vocab_size=llm.engine.vocab_size,
        async_scheduling=async_scheduling,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_every_sample_matches_its_constraint(llm, case):
    so = CASES[case]
    params = [
        SamplingParams(temperature=t, seed=i, max_tokens=MAX_TOKENS, structured_outputs=so)
        for i, t in enumerate((0.7, 0.85, 1.0, 1.0))
    ]
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params, use_tqdm=False)]
    if case == "json_object":  # any object: its strings are unbounded, a sample may run out of tokens
        assert all(c.text.startswith("{") for c in outs) and sum(c.finish_reason == "stop" for c in outs) >= 2
        outs = [c for c in outs if c.finish_reason == "stop"]
    for c in outs:
        assert c.finish_reason == "stop" and valid(c.text, so), (case, c.text, c.finish_reason)


def outside_strings(text: str) -> str:
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


def test_json_whitespace(llm):
    """disable_any_whitespace (the default) writes JSON with no whitespace between its tokens;
    False lets the model write llguidance's flexible whitespace (here: it does, and stays valid)."""
    outs = llm.generate(
        [PROMPT] * 3,
        [
            SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS, structured_outputs=SO(json=SCHEMA, disable_any_whitespace=d))
            for s in (1, 2)
            for d in (True, False)
            if s != 2 or not d
        ],
        use_tqdm=False,
    )  # fmt: skip
    compact, free = [outs[0].outputs[0].text], [outs[1].outputs[0], outs[2].outputs[0]]
    assert all(valid(t, SO(json=SCHEMA)) and not re.search(r"\s", outside_strings(t)) for t in compact), compact
    assert all(c.finish_reason == "length" or valid(c.text, SO(json=SCHEMA)) for c in free)
    assert any(re.search(r"\s", outside_strings(c.text)) for c in free), [c.text for c in free]


def test_grammar_completion_ends_the_sequence_with_ignore_eos_and_min_tokens(llm):
    """A complete grammar ends the sequence ("stop") even with ignore_eos or a min_tokens it has
    not reached: nothing else could follow."""
    so = SO(choice=CHOICES)
    params = [
        SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True, structured_outputs=so),
        SamplingParams(temperature=1.0, seed=2, max_tokens=20, min_tokens=10, structured_outputs=so),
    ]
    for out in llm.generate([PROMPT] * 2, params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in CHOICES


def test_n3_async_preemption_and_streaming(llm):
    """n=3 forks copy the matcher; async scheduling holds a constrained sequence back while its
    token is in flight; a pool small enough to preempt keeps the matchers across recompute;
    streamed deltas add up to valid outputs."""
    engine = engine_over(llm, async_scheduling=True, num_kv_blocks=24)
    so = {"a": SO(json=SCHEMA), "b": SO(regex=REGEX), "c": SO(grammar=LARK)}
    for rid, s in so.items():
        engine.add_request(rid, PROMPT, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS, structured_outputs=s))  # fmt: skip
    for k in range(2):  # unconstrained long ones compete for the blocks
        engine.add_request(f"free{k}", PROMPT, SamplingParams(temperature=1.0, seed=k, max_tokens=100, ignore_eos=True))  # fmt: skip
    streamed: dict[tuple[str, int], str] = {}
    final = {}
    constrained_preempted = 0
    while engine.has_unfinished_requests():
        seqs = [q for rid in so for q in engine.core.requests.get(rid, [])]
        constrained_preempted = max(constrained_preempted, sum(q.num_preemptions for q in seqs))
        for out in engine.step():
            for c in out.outputs:
                streamed[out.request_id, c.index] = streamed.get((out.request_id, c.index), "") + c.delta_text
            if out.finished:
                final[out.request_id] = out
    assert constrained_preempted > 0  # constrained sequences themselves were recomputed
    for rid, s in so.items():
        outs = final[rid].outputs
        assert len(outs) == 3
        for c in outs:
            assert c.finish_reason == "stop" and valid(c.text, s), (rid, c.text)
            assert streamed[rid, c.index] == c.text
        assert len({c.text for c in outs}) > 1  # three samples, not one copied


def _launches(engine):
    """Run to the end; per launch: the request ids in it, and those launched with a token in flight
    whose next logits need it (penalties, a grammar: Sequence.needs_history)."""
    launches: list[tuple[set[str], set[str]]] = []
    execute = engine.core.executor.execute_async

    def spy(sched):
        ids = {s.seq.request_id for s in sched.scheduled}
        blind = {s.seq.request_id for s in sched.scheduled if s.seq.needs_history and s.seq.num_pending}
        launches.append((ids, blind))
        return execute(sched)

    engine.core.executor.execute_async = spy
    while engine.has_unfinished_requests():
        engine.step()
    return launches


def test_async_constrained_sequence_waits_for_its_token(llm):
    """Under async scheduling, a sequence whose next logits need its last token (a grammar, a
    penalty) is never launched before that token is resolved. When such sequences are most of the
    batch the core resolves the step in flight first (full batches); when they are few they sit
    out one step while the free ones run every step."""
    g = SamplingParams(temperature=1.0, seed=1, max_tokens=12, structured_outputs=SO(regex="[a-z]{12}"))
    p = SamplingParams(temperature=1.0, seed=1, max_tokens=12, presence_penalty=1.0)
    f = SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)
    mostly = engine_over(llm, async_scheduling=True, num_kv_blocks=40)
    for rid, params in (("g", g), ("p", p), ("f", f)):
        mostly.add_request(rid, PROMPT, params)
    launches = _launches(mostly)
    assert not any(blind for _, blind in launches), launches
    assert any({"g", "p"} <= a and {"g", "p"} <= b for (a, _), (b, _) in zip(launches, launches[1:], strict=False))
    few = engine_over(llm, async_scheduling=True, num_kv_blocks=40)
    for rid, params in (("g", g), ("f1", f), ("f2", f), ("f3", f)):
        few.add_request(rid, PROMPT, params)
    launches = _launches(few)
    assert not any(blind for _, blind in launches), launches
    for (a, _), (b, _) in zip(launches, launches[1:], strict=False):
        assert not ("g" in a and "g" in b), launches  # it waits out the step its token is in
    assert any("f1" in a and "f1" in b for (a, _), (b, _) in zip(launches, launches[1:], strict=False))


@pytest.mark.parametrize(
    ("so", "needle"),
    [
        (SO(json={"type": "object", "properties": {"a": {"type": "frob"}}}), "frob"),
        (SO(json="{not json"), "json"),
        (SO(regex="a(b"), "unclosed group"),
        (SO(grammar="start: undefined_rule"), "undefined_rule"),
    ],
)
def test_grammar_that_cannot_compile_is_refused(llm, so, needle):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    assert e.value.param == "structured_outputs" and needle in str(e.value), str(e.value)


def test_core_without_tokenizer_refuses(llm):
    engine = engine_over(llm, async_scheduling=False, num_kv_blocks=16, tokenizer=False)
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=4, structured_outputs=SO(choice=["a"])))
    assert e.value.param == "structured_outputs"
    assert not engine.has_unfinished_requests()


def test_compiled_grammar_is_cached(llm):
    def run(so: SO) -> None:
        llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=0, max_tokens=20, structured_outputs=so), use_tqdm=False)  # fmt: skip

    run(SO(regex="[0-9]{3}"))
    manager = llm.engine.core.structured_output
    assert manager is not None
    before = manager.num_compiled
    run(SO(regex="[0-9]{3}"))  # the same grammar: not compiled again
    assert manager.num_compiled == before
    run(SO(regex="[0-9]{4}"))
    assert manager.num_compiled == before + 1


def test_grammar_that_fails_only_over_the_tokenizer_is_refused_before_queueing(llm):
    """`<[99999]>` reads as a grammar alone and fails over the model's 8,192-id tokenizer: the edge
    compiles it over that tokenizer (issue 36), so it is an InvalidRequestError, not an empty answer."""
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([PROMPT], SamplingParams(max_tokens=4, structured_outputs=SO(grammar="start: <[99999]>")), use_tqdm=False)  # fmt: skip
    assert e.value.param == "structured_outputs" and "99999" in str(e.value), str(e.value)
    assert not llm.engine.has_unfinished_requests()


def test_a_grammar_the_core_cannot_compile_ends_with_an_error_not_an_empty_answer(llm):
    """The core compiles again (an engine fed without its edge check): a failure there ends the
    request with finish_reason "error" and llguidance's message, its fork too."""
    engine = engine_over(llm, async_scheduling=False, num_kv_blocks=16)
    so = SO(grammar="start: <[99999]>")
    engine.core.add_request(
        EngineCoreRequest("bad", "", [5, 6, 7], SamplingParams(n=2, max_tokens=4, structured_outputs=so), 0.0)
    )
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.core.step()
    ended = [o for o in outs if o.finish_reason is not None]
    assert sorted(o.index for o in ended) == [0, 1]
    assert all(o.finish_reason == "error" and not o.new_token_ids for o in ended)
    assert all("99999" in (o.error or "") for o in ended), ended
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_an_llguidance_that_cannot_build_the_tokenizer_is_a_clear_error(llm, monkeypatch):
    """llguidance 1.6 took one EOS id, not a list: its TypeError used to end every constrained
    request empty with finish_reason "abort". Now the edge says what is wrong, naming llguidance."""
    import llguidance.hf

    from pagedllm.engine.grammar import GrammarCompileError

    def old_from_tokenizer(*args, **kwargs):
        raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", old_from_tokenizer)
    engine = engine_over(llm, async_scheduling=False, num_kv_blocks=16)
    with pytest.raises(GrammarCompileError, match="llguidance could not build its tokenizer.*eos_token"):
        engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=4, structured_outputs=SO(choice=["yes", "no"])))
    assert not engine.has_unfinished_requests()


# --- strict JSON schemas: an object schema without additionalProperties allows no unlisted key ---

OPEN = {  # SCHEMA without additionalProperties, at either level
    "type": "object",
    "properties": {**SCHEMA["properties"], "pos": {k: v for k, v in SCHEMA["properties"]["pos"].items() if k != "additionalProperties"}},
    "required": SCHEMA["required"],
}  # fmt: skip


def accepts(llm: LLM, schema: dict, text: str) -> bool:
    """Whether the grammar the engine compiles for `schema` takes `text` whole (over the model's
    tokenizer, as the engine compiles it)."""
    from llguidance import LLMatcher

    from pagedllm.engine.grammar import grammar_key, grammar_spec

    manager = llm.engine.core._grammar_manager()  # made on the first structured request: maybe not yet on this worker
    tok = manager.tokenizer()
    matcher = LLMatcher(tok, grammar_spec(grammar_key(SO(json=schema))), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tok.tokenize_str(text)) and matcher.is_accepting()


def test_schema_without_additional_properties_refuses_unlisted_keys(llm):
    """The compiled grammar itself refuses an unlisted key, at the top level and nested (llguidance
    alone reads a missing additionalProperties as `true`)."""
    good = '{"name":"a","kind":"cat","tags":[],"pos":{"x":1}}'
    assert accepts(llm, OPEN, good)
    assert not accepts(llm, OPEN, good[:-1] + ',"extra":"x"}')
    assert not accepts(llm, OPEN, good.replace('{"x":1}', '{"x":1,"y":2}'))  # nested


@pytest.mark.parametrize(
    "where, schema, text",
    [
        ("items", {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "integer"}}}}, '[{"a":1,"b":2}]'),
        ("$defs", {"$defs": {"P": {"type": "object", "properties": {"a": {"type": "integer"}}}}, "$ref": "#/$defs/P"}, '{"a":1,"b":2}'),
        ("anyOf", {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "null"}]}, '{"a":1,"b":2}'),
        ("additionalProperties", {"type": "object", "additionalProperties": {"type": "object", "properties": {"a": {"type": "integer"}}}}, '{"k":{"a":1,"b":2}}'),
    ],
)  # fmt: skip
def test_nested_object_schemas_are_strict_too(llm, where, schema, text):
    assert not accepts(llm, schema, text), where
    assert accepts(llm, schema, text.replace(',"b":2', "")), where


def test_explicit_additional_properties_is_honoured(llm):
    base = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert accepts(llm, {**base, "additionalProperties": True}, '{"a":1,"b":"x"}')
    ints = {**base, "additionalProperties": {"type": "integer"}}
    assert accepts(llm, ints, '{"a":1,"b":2}')
    assert not accepts(llm, ints, '{"a":1,"b":"x"}')
    pattern = {**base, "patternProperties": {"^x_": {"type": "string"}}}  # pattern keys stay allowed
    assert accepts(llm, pattern, '{"a":1,"x_q":"s"}') and not accepts(llm, pattern, '{"a":1,"q":"s"}')
    assert accepts(llm, {"type": "object"}, '{"any":1}')  # no properties listed: any object
    assert accepts(llm, {"allOf": [base, {"properties": {"b": {"type": "integer"}}}]}, '{"a":1,"b":2}')  # kept open


def test_strict_schema_copies_and_the_key_is_the_schema_as_sent():
    from pagedllm.engine.grammar import grammar_key, strict_schema

    schema = json.loads(json.dumps(OPEN))
    strict = strict_schema(schema)
    assert schema == OPEN  # the caller's schema is not changed
    assert strict["additionalProperties"] is False and strict["properties"]["pos"]["additionalProperties"] is False
    assert "additionalProperties" not in strict["properties"]["tags"]["items"]  # a string schema
    assert strict_schema(strict) == strict and strict_schema(SCHEMA) == SCHEMA  # already strict: the same
    assert grammar_key(SO(json=OPEN)).text == json.dumps(OPEN)


def test_sampled_json_never_adds_an_unlisted_key(llm):
    """Seeded samples of a schema without additionalProperties (one of these seeds used to add a key
    whose string ran to max_tokens): each stops, and is valid against the strict schema."""
    from pagedllm.engine.grammar import strict_schema

    manager = llm.engine.core._grammar_manager()  # made on the first structured request: maybe not yet on this worker
    before = manager.num_compiled
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS, structured_outputs=SO(json=OPEN)) for s in range(10)]  # fmt: skip
    for out in llm.generate([PROMPT] * len(params), params, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), strict_schema(OPEN))
    assert manager.num_compiled == before + 1  # one schema, one grammar
