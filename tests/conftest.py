"""Fixtures shared by the PyTorch test modules."""

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's torch code on one thread, and restore the count afterwards.

    A 64-wide test model gains nothing from a second thread, and when the 2 cores
    are busy, OpenMP's waits for a second thread make every small forward many
    times slower.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
