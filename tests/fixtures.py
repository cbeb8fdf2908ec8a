"""Fixtures shared by several test folders (each folder's conftest imports the ones it uses)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread in this process, as in each spawned rank (launch gives a rank
    cpu_count // world). On the 2-core machine two spinning OpenMP threads next to other busy
    processes made a tiny-model step 50x slower (12 s instead of 0.25 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
