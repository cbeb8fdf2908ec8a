from tests.ops.kda.conftest import nan_filled_empty  # noqa: F401  (fresh tensors NaN-filled, as for KDA)
