"""Suite-wide: W&B's offline runs of the commands under test go to a temporary folder, never into the checkout's
reports/wandb (a command logs offline by default where wandb is installed). Tests of the default folder clear
WANDB_DIR themselves (`clean_env` in tests/tracking/test_wandb_log.py)."""

import pytest


@pytest.fixture(autouse=True)
def wandb_dir_outside_the_checkout(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path_factory.mktemp("wandb")))
