"""Suite-wide: W&B's offline runs of the commands under test go to a temporary folder, never into the checkout's
reports/wandb (a command logs offline by default where wandb is installed). Tests of the default folder clear
WANDB_DIR themselves (`clean_env` in tests/tracking/test_wandb_log.py). `deterministic_cuda`: torch's deterministic
algorithms for a test that repeats a CUDA computation bit for bit."""

import pytest


@pytest.fixture(autouse=True)
def wandb_dir_outside_the_checkout(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path_factory.mktemp("wandb")))


@pytest.fixture
def deterministic_cuda(monkeypatch):
    """torch's deterministic algorithms for the test, restored after it (cuBLAS wants a fixed workspace)."""
    import torch

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
