"""Kernel tests run on CUDA when present, else through Triton's interpreter on CPU.

TRITON_INTERPRET must be set before any kernel module is decorated, so it is set here,
before the test modules import pagedllm.ops.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (GPU-sized shapes); skipped without it")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")
