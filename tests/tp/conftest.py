import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Rank 0 (this process) and its workers share a small CPU: with several OpenMP threads
    each they spin against each other and a tiny model's step gets 100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
