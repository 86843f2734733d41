"""TP failure handling: bad head counts fail at start-up, a dead or failing worker makes
the engine raise (naming the rank) instead of hanging until the collectives' timeout, and
workers never outlive the engine's process."""

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pagedllm import LLM, SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)
# A dead worker is found by the executor, not waited out: well under the collectives' timeout
# (PAGEDLLM_TP_TIMEOUT_S, set to TIMEOUT_S below), and generous for a busy box (a bound, not a speed).
FOUND_S, TIMEOUT_S = 60.0, 600


@pytest.fixture
def long_tp_timeout(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_TP_TIMEOUT_S", str(TIMEOUT_S))


def tp2(path):
    return LLM(path, tensor_parallel_size=2, num_kv_blocks=64, block_size=8)


def test_head_count_not_divisible_fails_at_startup(tiny_models):
    others = set(multiprocessing.active_children())  # e.g. a live test server's engine core
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=3 must divide num_attention_heads \(4\), "
        r"num_key_value_heads \(2\).*not replicated",
    ):
        LLM(tiny_models["qwen3"], tensor_parallel_size=3)
    assert set(multiprocessing.active_children()) <= others


def test_killed_worker_fails_the_next_generate_fast(tiny_models, long_tp_timeout):
    others = set(multiprocessing.active_children())
    llm = tp2(tiny_models["qwen3"])
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    worker = llm.runner.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) died \(signal SIGKILL\)"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    assert time.monotonic() - t < FOUND_S
    with pytest.raises(RuntimeError, match="shut down after an earlier error.*rank 1"):
        llm.generate([[4, 5]], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.close()
    assert set(multiprocessing.active_children()) <= others


def test_worker_killed_mid_step_fails_fast(tiny_models, long_tp_timeout):
    """The worker dies after rank 0 has shipped a step, while rank 0 runs its forward: the
    collective fails (gloo sees the connection close) and the executor names the rank."""
    llm = tp2(tiny_models["llama"])
    pid = llm.runner.procs[0].pid
    real_run, steps = llm.runner.driver.run, []

    def run(inp):
        steps.append(1)
        if len(steps) == 3:
            os.kill(pid, signal.SIGKILL)
        return real_run(inp)

    llm.runner.driver.run = run
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 .*died"):
        llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)
    assert time.monotonic() - t < FOUND_S and len(steps) == 3
    llm.close()


def test_worker_exception_surfaces_on_rank_0_with_its_traceback(tiny_models):
    llm = tp2(tiny_models["qwen2"])
    llm.runner.channel.send("not a StepInputs")  # the worker raises before any collective
    with pytest.raises(RuntimeError, match=r"(?s)worker rank 1 failed:.*AttributeError"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    llm.close()


def test_workers_exit_when_the_engine_process_dies(tiny_models, tmp_path):
    script = textwrap.dedent(f"""
        import os
        from pagedllm import LLM
        if __name__ == "__main__":
            llm = LLM({tiny_models["qwen3"]!r}, tensor_parallel_size=2, num_kv_blocks=16, block_size=8)
            print(llm.runner.procs[0].pid, flush=True)
            os._exit(0)          # no close(), no atexit: as if killed
    """)
    (tmp_path / "die.py").write_text(script)
    out = subprocess.run(
        [sys.executable, str(tmp_path / "die.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 60  # a bound for a hang, not a speed
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:
            with open(f"/proc/{pid}/stat") as f:  # a zombie awaiting its reaper counts as gone
                if f.read().split(")")[-1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    pytest.fail(f"worker {pid} outlived its engine process")
