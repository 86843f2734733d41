"""Kernel tests run on CUDA when present, else through Triton's interpreter on CPU (chosen in
tests/conftest.py, which also skips the `gpu`-marked tests without CUDA)."""

import pytest
import torch


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
