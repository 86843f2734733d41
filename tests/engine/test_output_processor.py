"""The output processor alone, no model: token ids in (EngineCoreOutputs), text and deltas out.

The tokenizer is byte-level: one token per UTF-8 byte, so a character of two or more bytes is
split across tokens and a partial one decodes as U+FFFD, as with byte-level BPE."""

from __future__ import annotations

import pytest

from pagedllm.engine.executor import TokenLogprobs
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.sampling_params import SamplingParams


class ByteTokenizer:
    def __init__(self):
        self.decoded_tokens = 0  # token ids passed to decode(), summed over calls

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        self.decoded_tokens += len(ids)
        return bytes(ids).decode("utf-8", errors="replace")


def ids(text: str) -> list[int]:
    return list(text.encode())


def run(tokens, *, stream=True, per_output=1, finish="length", stop_reason=None, tok=None, **params):
    """Feed `tokens` as the core would (one EngineCoreOutput per token, the last one finishing
    with `finish`) and ask for an output every `per_output` tokens, as a consumer of that pace.
    Stops feeding once the processor reports a stop string (the owner aborts it in the core).
    Returns (outputs, processor)."""
    proc = OutputProcessor(tok or ByteTokenizer())
    params.setdefault("max_tokens", 100)
    request = EngineCoreRequest("r", "p", ids("p"), SamplingParams(**params), 0.0)
    state = proc.add_request(request, stream)
    outs = []
    for i, t in enumerate(tokens):
        last = i == len(tokens) - 1
        done = proc.process(
            [EngineCoreOutput("r", 0, [t], finish if last else None, stop_reason if last else None, 0, 1.0, 2.0)]
        )
        assert done.touched == [state]
        if (stream and ((i + 1) % per_output == 0 or state.finished)) or (not stream and state.finished):
            outs.append(proc.make_output(state))
        if done.stopped:
            assert done.stopped == [("r", 0)] and state.finished
            assert proc.process([EngineCoreOutput("r", 0, [t], None)]).touched == []  # later tokens: dropped
            break
    return outs, proc


def final(outs):
    assert outs[-1].finished
    return outs[-1].outputs[0]


def deltas(outs) -> str:
    return "".join(o.outputs[0].delta_text for o in outs)


@pytest.mark.parametrize("per_output", [1, 3, 100])
def test_a_stop_string_across_token_boundaries_cuts_the_text(per_output):
    tokens = ids("hello world, bye")
    outs, _ = run(tokens, per_output=per_output, stop=["o w"])
    o = final(outs)
    assert (o.text, o.finish_reason, o.stop_reason) == ("hell", "stop", "o w")
    assert o.token_ids == ids("hello w")  # up to the token that completed it; later ones dropped
    assert deltas(outs) == "hell"


def test_a_stop_string_within_one_output_drops_the_later_tokens():
    proc = OutputProcessor(ByteTokenizer())
    state = proc.add_request(EngineCoreRequest("r", None, [1], SamplingParams(stop="cd", max_tokens=50), 0.0), True)
    done = proc.process([EngineCoreOutput("r", 0, ids("abcdef"), None)])
    assert done.stopped == [("r", 0)] and done.finished == [state]
    o = proc.make_output(state).outputs[0]
    assert (o.text, o.token_ids, o.finish_reason, o.stop_reason) == ("ab", ids("abcd"), "stop", "cd")


def test_held_back_text_is_never_emitted_then_retracted():
    outs, _ = run(ids("12ab34abc56"), stop=["abc"])
    text = final(outs).text
    assert text == "12ab34"
    sent = ""
    for o in outs:
        sent += o.outputs[0].delta_text
        assert text.startswith(sent), sent  # what went out is never cut afterwards
    assert sent == text
    # while "ab" might still become "abc", it is held back
    assert all(not o.outputs[0].delta_text.endswith("ab") for o in outs[:-1])


@pytest.mark.parametrize("per_output", [1, 2, 100])
def test_a_character_split_across_tokens_is_emitted_whole(per_output):
    text = "aé日b🙂"
    outs, _ = run(ids(text), per_output=per_output)
    assert all("\ufffd" not in o.outputs[0].delta_text for o in outs)
    assert deltas(outs) == final(outs).text == text


def test_the_final_flush_emits_an_incomplete_character_as_decode_all_does():
    tokens = ids("a") + ids("日")[:2]  # the last character never completes
    streamed, _ = run(tokens, finish="length")
    whole, _ = run(tokens, stream=False, finish="length")
    assert final(whole).text == "a\ufffd"
    assert final(streamed).text == "a\ufffd" and deltas(streamed) == "a\ufffd"
    assert streamed[-1].outputs[0].delta_text == "\ufffd"


def test_an_aborted_stream_is_not_flushed():
    proc = OutputProcessor(ByteTokenizer())
    state = proc.add_request(EngineCoreRequest("r", None, [1], SamplingParams(), 0.0), True)
    proc.process([EngineCoreOutput("r", 0, ids("a"), None)])
    assert proc.make_output(state).outputs[0].text == "a"
    proc.process([EngineCoreOutput("r", 0, ids("日")[:2], None)])
    assert proc.abort_request("r") is state and "r" not in proc.requests
    o = proc.make_output(state).outputs[0]
    assert (o.text, o.finish_reason) == ("a", "abort")


def test_stop_strings_wait_for_min_tokens():
    outs, _ = run(ids("xyAxyB"), stop=["xy"], min_tokens=3)
    assert (final(outs).text, final(outs).stop_reason) == ("xyA", "xy")
    outs, _ = run(ids("xyAxyB"), stop=["xy"])
    assert final(outs).text == ""


def test_stop_token_and_stop_string_finish_reasons():
    # a stop token: the core finished it; its text is kept and flushed
    outs, _ = run(ids("ok!"), finish="stop", stop_reason=ids("!")[0], stop=["zz"])
    o = final(outs)
    assert (o.text, o.finish_reason, o.stop_reason) == ("ok!", "stop", ids("!")[0])
    # a stop string completed by the token that finished the request anyway is not a stop-string hit
    outs, _ = run(ids("xyz"), finish="length", stop=["yz"])
    o = final(outs)
    assert (o.text, o.finish_reason, o.stop_reason) == ("xyz", "length", None)
    # the same string one token earlier is
    outs, _ = run(ids("xyzw"), finish="length", stop=["yz"])
    o = final(outs)
    assert (o.text, o.finish_reason, o.stop_reason) == ("x", "stop", "yz")


@pytest.mark.parametrize("stop", [None, ["é!"], ["nope"]])
@pytest.mark.parametrize("per_output", [1, 4])
def test_streamed_deltas_concatenate_to_the_non_streamed_text(stop, per_output):
    tokens = ids("héllo, 日本 é! wörld 🙂 end")
    streamed, _ = run(tokens, per_output=per_output, stop=stop)
    whole, _ = run(tokens, stream=False, stop=stop)
    assert len(whole) == 1
    assert deltas(streamed) == final(streamed).text == final(whole).text == whole[0].outputs[0].delta_text
    assert final(streamed).token_ids == final(whole).token_ids
    assert [t for o in streamed for t in o.outputs[0].delta_token_ids] == final(streamed).token_ids


def test_a_request_without_stop_strings_that_is_not_streamed_decodes_once_at_the_end():
    tok = ByteTokenizer()
    proc = OutputProcessor(tok)
    state = proc.add_request(EngineCoreRequest("r", None, [1], SamplingParams(), 0.0), stream=False)
    for t in ids("abcdef"):
        proc.process([EngineCoreOutput("r", 0, [t], None)])
    assert tok.decoded_tokens == 0  # nothing decoded before the end
    proc.process([EngineCoreOutput("r", 0, ids("g"), "length")])
    assert proc.make_output(state).outputs[0].text == "abcdefg"
    n = tok.decoded_tokens
    assert proc.make_output(state).outputs[0].text == "abcdefg" and tok.decoded_tokens == n  # decoded once


def test_a_consumer_that_falls_behind_gets_one_output_with_everything_new():
    proc = OutputProcessor(ByteTokenizer())
    state = proc.add_request(EngineCoreRequest("r", None, [1], SamplingParams(), 0.0), True)
    proc.process([EngineCoreOutput("r", 0, ids("ab"), None, num_cached_tokens=0, first_token_time=1.0)])
    first = proc.make_output(state).outputs[0]
    for t in ids("cdé"):
        proc.process([EngineCoreOutput("r", 0, [t], None)])
    second = proc.make_output(state)
    o = second.outputs[0]
    assert (first.delta_text, o.delta_text, o.text) == ("ab", "cdé", "abcdé")
    assert o.delta_token_ids == ids("cdé") and not second.finished
    assert second.metrics.first_token_time == 1.0 and state.has_new_tokens is False


def test_n_sequences_keep_their_own_state():
    proc = OutputProcessor(ByteTokenizer())
    state = proc.add_request(EngineCoreRequest("r", None, [1], SamplingParams(n=2, stop="!"), 0.0), True)
    done = proc.process([EngineCoreOutput("r", 0, ids("a!"), None), EngineCoreOutput("r", 1, ids("bc"), None)])
    assert done.stopped == [("r", 0)] and not state.finished
    out = proc.make_output(state)
    assert [(o.index, o.text, o.finish_reason) for o in out.outputs] == [(0, "a", "stop"), (1, "bc", None)]
    done = proc.process([EngineCoreOutput("r", 0, ids("x"), None), EngineCoreOutput("r", 1, ids("d"), "length")])
    out = proc.make_output(state)
    assert done.finished == [state] and out.finished
    assert [(o.text, o.delta_token_ids) for o in out.outputs] == [("a", []), ("bcd", ids("d"))]


def test_a_stop_string_inside_one_output_cuts_its_logprobs_and_the_sum():
    proc = OutputProcessor(ByteTokenizer())
    params = SamplingParams(n=2, best_of=3, stop="cd", logprobs=1, max_tokens=50)
    state = proc.add_request(EngineCoreRequest("r", None, [1], params, 0.0), stream=True)
    assert not state.stream  # best_of > n: never streamed

    def lps(text, base):
        return [TokenLogprobs([t, 7], [base - i, -0.1], 2) for i, t in enumerate(ids(text))]

    done = proc.process(
        [
            EngineCoreOutput("r", 0, ids("abcdef"), None, new_logprobs=lps("abcdef", -1.0)),
            EngineCoreOutput("r", 1, ids("xy"), "length", new_logprobs=lps("xy", -0.5)),
            EngineCoreOutput("r", 2, ids("zw"), "length", new_logprobs=lps("zw", -3.0)),
        ]
    )
    assert done.stopped == [("r", 0)] and done.finished == [state]
    out = proc.make_output(state).outputs
    # kept: "abcd" (-1 -2 -3 -4 = -10), "xy" (-0.5 -1.5 = -2), "zw" (-3 -4 = -7): the best two, re-indexed
    assert [(o.index, o.token_ids, o.cumulative_logprob) for o in out] == [(0, ids("xy"), -2.0), (1, ids("zw"), -7.0)]
    assert [list(d) for d in out[0].logprobs] == [[ids("x")[0], 7], [ids("y")[0], 7]]
    assert out[0].logprobs[0][7].decoded_token == "\x07" and out[0].logprobs[0][7].rank == 1
    assert proc.requests == {}
