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


@pytest.fixture
def packed_gdn_kernels(monkeypatch) -> list[str]:
    """The `kernel` of every packed GDN call (harts.ops.gdn.packed.packed_gdn) made while the test runs."""
    from harts.ops.gdn import packed

    kernels = []
    original = packed.packed_gdn

    def spy(*args, **kwargs):
        kernels.append(kwargs["kernel"])
        return original(*args, **kwargs)

    monkeypatch.setattr(packed, "packed_gdn", spy)
    return kernels
