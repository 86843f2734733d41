"""The sharing traces, through LLMEngine and the shadow-KV runner (block size 16, a budget of 8,192
tokens, a pool that never evicts), against the hit tokens of vLLM v1's algorithm (a block is
findable once the step writing it is scheduled; hits in whole blocks; the last prompt token is
always computed). Each assertion allows 2%; the numbers come out exact."""

from __future__ import annotations

import random

import pytest

from tests.engine.sharing_harness import Req, make_engine

BS = 16
SYSTEM = 512
CONVERSATIONS, TURNS = 10, 5


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(97) for _ in range(n)]


def drain_all(engine) -> dict[str, list[list[int]]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [o.token_ids for o in out.outputs]
    return done


def within_2pct(measured: int, vllm: int) -> bool:
    return abs(measured - vllm) <= 0.02 * vllm


def burst_trace(shared: int, own: int, num: int = 50):
    """`num` requests of (shared + own) tokens added before the first step, 2 output tokens each."""
    rng = random.Random(shared)
    prefix = tokens(rng, shared)
    reqs = [Req(f"r{i}", prefix + tokens(rng, own), 2, seed=i) for i in range(num)]
    engine, runner = make_engine(block_size=BS, num_kv_blocks=8192, budget=8192)
    for r in reqs:
        engine.add_request(r.rid, r.prompt, r.params())
    assert drain_all(engine) == {r.rid: r.expected() for r in reqs}
    return engine.get_metrics(), runner


@pytest.mark.parametrize(("shared", "vllm"), [(1024, 50_176), (256, 12_544)])
def test_a_burst_behind_a_shared_prefix(shared, vllm):
    # vLLM: the first request computes the prefix, the 49 admitted after it in the same step hit it
    assert vllm == 49 * (shared // BS * BS)
    m, runner = burst_trace(shared, 32)
    assert within_2pct(m["prefix_cache_hit_tokens"], vllm), m["prefix_cache_hit_tokens"]
    assert m["prefix_cache_hit_tokens"] == vllm
    assert runner.executed_prompt_tokens == 50 * (shared + 32) - vllm
    if shared == 256:
        assert round(m["prefix_cache_hit_rate"], 2) == 0.87


def conversation_lengths(c: int) -> tuple[int, int]:
    """Conversation c: user turns of 32 + 4c tokens, assistant answers of 32 + 2c tokens."""
    return 32 + 4 * c, 32 + 2 * c


def vllm_conversation_hits() -> int:
    """vLLM's arithmetic for the conversation trace. Turn 1 of the ten conversations arrives
    together: the first computes the system prompt, nine hit its 32 blocks (9 x 512 = 4,608).
    Turn t > 1 of conversation c re-sends system + (t - 1) x (user + assistant) + a new user
    turn; everything but the previous answer's last token (sampled, never fed back) was
    computed and cached, so it hits floor((512 + (t - 1)(u + a) - 1) / 16) blocks: 29,168 over
    the forty later turns. 4,608 + 29,168 = 33,776."""
    later = sum(
        (SYSTEM + (t - 1) * sum(conversation_lengths(c)) - 1) // BS * BS
        for c in range(CONVERSATIONS)
        for t in range(2, TURNS + 1)
    )
    return (CONVERSATIONS - 1) * SYSTEM + later


def test_conversations_behind_a_system_prompt():
    assert vllm_conversation_hits() == 33_776
    rng = random.Random(7)
    system = tokens(rng, SYSTEM)
    engine, runner = make_engine(block_size=BS, num_kv_blocks=8192, budget=8192, check_writes=False)
    history = {c: list(system) for c in range(CONVERSATIONS)}
    turn = dict.fromkeys(range(CONVERSATIONS), 0)
    expected_outputs = {}

    def send(c: int) -> None:
        user, answer = conversation_lengths(c)
        history[c] += tokens(rng, user)
        r = Req(f"c{c}t{turn[c]}", list(history[c]), answer, seed=c)
        if c in (0, CONVERSATIONS - 1):  # the reference is slow: the shortest and longest conversations
            expected_outputs[r.rid] = r.expected()[0]
        engine.add_request(r.rid, r.prompt, r.params())

    for c in range(CONVERSATIONS):
        send(c)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            c = int(out.request_id[1 : out.request_id.index("t")])
            assert out.outputs[0].token_ids == expected_outputs.get(out.request_id, out.outputs[0].token_ids)
            history[c] += out.outputs[0].token_ids  # the answer is re-sent with the next turn
            turn[c] += 1
            if turn[c] < TURNS:
                send(c)
    assert all(t == TURNS for t in turn.values())
    m = engine.get_metrics()
    assert m["prefix_cache_requests"] == CONVERSATIONS * TURNS
    assert within_2pct(m["prefix_cache_hit_tokens"], 33_776), m["prefix_cache_hit_tokens"]
    assert m["prefix_cache_hit_tokens"] == 33_776
    engine.kv.pool.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_n8_samples_compute_the_prompt_once():
    prompt = tokens(random.Random(1), 1000)
    req = Req("n8", prompt, 4, n=8, seed=11)
    engine, runner = make_engine(block_size=BS, num_kv_blocks=8192, budget=8192)
    engine.add_request(req.rid, req.prompt, req.params())
    assert drain_all(engine) == {"n8": req.expected()}
    m = engine.get_metrics()
    assert runner.executed_prompt_tokens == 1000  # not 8 x 1,000
    assert m["num_prompt_tokens"] == 1000 and m["num_forked_sequences"] == 7
    assert m["num_copy_on_write_blocks"] == 7  # 1,000 = 62 x 16 + 8: the shared last block, copied by 7 of 8


def test_eight_separate_requests_share_in_their_first_step():
    """The same 8 samples sent as 8 requests (vLLM's n=8 in v1 before forks): the 7 admitted after
    the first hit 62 blocks each in the same step, 7 x 992 = 6,944 tokens; 1,056 prompt tokens run."""
    prompt = tokens(random.Random(1), 1000)
    reqs = [Req(f"s{i}", prompt, 4, seed=11 + i) for i in range(8)]
    engine, runner = make_engine(block_size=BS, num_kv_blocks=8192, budget=8192)
    for r in reqs:
        engine.add_request(r.rid, r.prompt, r.params())
    done = drain_all(engine)
    assert done == {r.rid: r.expected() for r in reqs}
    assert engine.get_metrics()["prefix_cache_hit_tokens"] == 6_944
    assert runner.executed_prompt_tokens == 1000 + 7 * 8
