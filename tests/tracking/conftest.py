"""The W&B tests run `harts bench speedup` on the benchmarks' small step, with one intra-op thread."""

from tests.bench.conftest import tree_step_path  # noqa: F401  (fixture)
from tests.fixtures import one_thread  # noqa: F401  (autouse fixture)
