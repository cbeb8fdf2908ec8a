"""One intra-op thread in this process (tests.fixtures.one_thread): keeps these tests' time predictable; `groups`:
the process groups of a one-rank gloo world in this process, for the tests that run the parallel step in place."""

import pytest
import torch
import torch.distributed as dist

from harts.parallel.config import load_parallel_config
from harts.parallel.groups import build_groups
from tests.fixtures import one_thread  # noqa: F401  (autouse fixture)


@pytest.fixture(scope="module")
def groups():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield build_groups(load_parallel_config("single"), torch.device("cpu"))
    dist.destroy_process_group()
