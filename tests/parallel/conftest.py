"""One intra-op thread in this process (tests.fixtures.one_thread): keeps these tests' time predictable."""

from tests.fixtures import one_thread  # noqa: F401  (autouse fixture)
