"""One intra-op thread in this process, as in each spawned rank (launch gives a rank cpu_count // world).

On the 2-core machine two spinning OpenMP threads next to other busy processes made a tiny-model
step 50x slower (12 s instead of 0.25 s); one thread keeps these tests' time predictable.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
