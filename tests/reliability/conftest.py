"""The reliability suite: `pagedllm serve` as a subprocess on the tiny random qwen3 (loopback,
CPU), driven by many concurrent clients, a seeded body fuzzer, idle sockets and signals.

CI sizes by default (two server processes, under a minute); `python -m pytest tests/reliability
--soak` runs the soak sizes (minutes): 1,000 streams, thousands of fuzz cases with a fresh seed
(`--soak-seed N` replays one), 1,000 idle sockets, and the --keep-alive-on-engine-death variant
of the engine-death test (one more server process). The option exists when tests/reliability is named on the command line (pytest reads the
options of the conftests under the paths it is given). Either way the figures (requests,
cancelled, lost, leaked blocks, fuzz cases by status class, timings) are printed in a
"reliability figures" section at the end of the run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil

import pytest

from tests.server.helpers import CHAT_TEMPLATE

FIGURES = pytest.StashKey[list]()


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How much each test does. `fuzz_seed` makes a fuzz run replayable."""

    soak: bool
    streams: int  # concurrent streams, half of them cancelled by their client
    stream_tokens: int  # tokens of every stream that is not cancelled
    fuzz_cases: int  # per body endpoint: each table value once, then random combinations up to this count
    fuzz_seed: int
    fuzz_concurrency: int
    idle_sockets: int
    kill_streams: int  # streams open when the engine core is killed
    sigterm_streams: int  # streams open (running and waiting) at SIGTERM


CI = dict(
    streams=64,
    stream_tokens=12,
    fuzz_cases=300,
    fuzz_concurrency=8,
    idle_sockets=250,
    kill_streams=24,
    sigterm_streams=48,
)
SOAK = dict(
    streams=1000,
    stream_tokens=16,
    fuzz_cases=3000,
    fuzz_concurrency=16,
    idle_sockets=1000,
    kill_streams=200,
    sigterm_streams=300,
)
CI_SEED = 12


def pytest_addoption(parser):
    g = parser.getgroup("reliability", "tests/reliability")
    g.addoption("--soak", action="store_true", default=False, help="run tests/reliability at soak sizes (minutes)")
    g.addoption("--soak-seed", type=int, default=None, help="the fuzzer's seed under --soak (default: a fresh one)")


@pytest.fixture(scope="session")
def sizes(pytestconfig) -> Sizes:
    soak = bool(pytestconfig.getoption("soak", False))
    seed = pytestconfig.getoption("soak_seed", None)
    if not soak:
        seed = CI_SEED
    elif seed is None:
        seed = random.SystemRandom().randrange(2**31)
    return Sizes(soak=soak, fuzz_seed=seed, **(SOAK if soak else CI))


@pytest.fixture(scope="session")
def figures(pytestconfig) -> list:
    """Lines for the "reliability figures" section of the terminal summary."""
    return pytestconfig.stash.setdefault(FIGURES, [])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(FIGURES, [])
    if lines:
        terminalreporter.section("reliability figures")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def reliability_model(tiny_models, tmp_path_factory) -> str:
    """The tiny qwen3 with a 4,096-token context (streams long enough to be killed mid-way)
    and a ChatML chat template in its tokenizer_config.json (so `serve` has /v1/chat)."""
    d = tmp_path_factory.mktemp("reliability_model")
    src = tiny_models["qwen3"]
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), d / f)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    (d / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((d / "tokenizer_config.json").read_text())
    tok["chat_template"] = CHAT_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(tok))
    return str(d)
