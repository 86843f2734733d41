"""Several hosts' mechanism, on one: `torchrun --nproc-per-node 2` (CPU, gloo) runs
examples/tp_torchrun.py; rank 0 prints the generations, rank 1 serves steps inside
LLM(...) and exits cleanly when rank 0 closes."""

import json
import os
import signal
import subprocess
import sys

import pytest

from pagedllm import envs
from tests.tp.common import PREEMPTING, hf_reference, workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # 9 s on 2 cores: run after the README command (.ci/run)
def test_torchrun_two_ranks_match_hf(tiny_models):
    path = tiny_models["qwen3"]
    prompts, _ = workload()
    max_tokens = 10
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "examples/tp_torchrun.py",
        "--model",
        path,
        "--device",
        "cpu",
        "--prompt-ids",
        json.dumps(prompts),
        "--max-tokens",
        str(max_tokens),
        "--block-size",
        str(PREEMPTING["block_size"]),
        "--num-kv-blocks",
        str(PREEMPTING["num_kv_blocks"]),
        "--max-num-batched-tokens",
        str(PREEMPTING["max_num_batched_tokens"]),
    ]
    env = {k: v for k, v in os.environ.items() if k not in envs.torchrun_keys()}  # a launch of its own
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks
        stdout, stderr = proc.communicate()
        raise AssertionError(f"torchrun timed out:\n{stdout}\n{stderr}") from None
    assert proc.returncode == 0, stdout + stderr
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    got = [r["token_ids"] for r in rows if "token_ids" in r]
    assert got == hf_reference(path, prompts, [max_tokens] * len(prompts))
    assert rows[-1]["num_preemptions"] > 0
