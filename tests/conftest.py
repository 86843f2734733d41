"""Shared fixtures: tiny random-weight HF models of each family and a small trained BPE
tokenizer, written once per session to a temp directory (no downloads); and the one place
GPU tests are skipped on a host without CUDA (tests marked `gpu`, a marker registered in
pyproject.toml, which also deselects them unless `-m gpu` is given)."""

from __future__ import annotations

import os

# One intra-op thread, here and in every process the tests start (they inherit the environment):
# the tiny models' ops are too small to gain from a second thread, and on a 2-core machine shared
# with the suite's own servers and engine cores an OpenMP thread that waits for a descheduled
# partner makes a step several times slower (a 24-token generate: 0.5 s with one thread, 3 s with
# two). Set before torch is imported, so that its thread pool starts with this size.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from pagedllm import envs
from tests.helpers import FAMILIES, build_model, build_tokenizer

# Kernels run through Triton's interpreter without a GPU. It must be chosen before anything
# imports triton (transformers may), so it is set here, before any test module is imported.
if not torch.cuda.is_available():
    envs.default_triton_interpret()

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    tok_dir = str(root / "tokenizer")
    build_tokenizer(tok_dir)
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tok_dir).eos_token_id
    dirs = {}
    for fam in FAMILIES:
        d = str(root / fam)
        build_model(fam, d, eos)
        for f in os.listdir(tok_dir):
            with open(os.path.join(tok_dir, f), "rb") as src, open(os.path.join(d, f), "wb") as dst:
                dst.write(src.read())
        dirs[fam] = d
    return dirs


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
