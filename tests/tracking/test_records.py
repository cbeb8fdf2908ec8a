"""harts.tracking.records: SIGTERM as an exception, once, and the handler restored (`sigterm_raises`);
the git state of the checkout, or the source sha given for a copied working tree (`git_state`)."""

import os
import signal
import subprocess

import pytest

from harts.tracking.records import Terminated, git_state, sigterm_raises


def test_first_sigterm_raises_later_ones_are_ignored_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_raises():
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
        # Writing the error row must not be interrupted by a second SIGTERM.
        os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before


def test_handler_restored_after_an_exception():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError), sigterm_raises():
        raise ValueError("boom")
    assert signal.getsignal(signal.SIGTERM) is before


def test_git_state_of_a_checkout_or_the_given_source(monkeypatch, tmp_path):
    monkeypatch.delenv("HARTS_SOURCE_SHA", raising=False)
    assert git_state(tmp_path) == {"sha": None, "dirty": None}  # not a checkout
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f").write_text("a")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    assert git_state(tmp_path) == {"sha": sha, "dirty": False}
    (tmp_path / "f").write_text("b")
    assert git_state(tmp_path) == {"sha": sha, "dirty": True}
    monkeypatch.setenv("HARTS_SOURCE_SHA", "0a36d3d")
    assert git_state(tmp_path) == {"sha": "0a36d3d", "dirty": None, "from": "HARTS_SOURCE_SHA"}


@pytest.mark.parametrize("name", ["transformers", "trl", "verl", "accelerate", "datasets"])
def test_environment_names_the_trainer_packages_once_imported(monkeypatch, name):
    """A record of a trainer benchmark names the versions of the trainer, transformers and their loaders it ran."""
    import sys
    import types

    from harts.tracking import records

    monkeypatch.delitem(sys.modules, name, raising=False)
    assert name not in records.environment()["versions"]
    module = types.ModuleType(name)
    module.__version__ = "9.8.7"
    monkeypatch.setitem(sys.modules, name, module)
    assert records.environment()["versions"][name] == "9.8.7"


def test_environment_names_the_optional_attention_kernels_in_use(monkeypatch):
    """flash-attn-4 and the CuTe DSL are recorded by their distributions' versions once imported, not before."""
    import importlib.metadata
    import sys
    import types

    from harts.tracking import records

    def version(name):
        if name != "flash-attn-4":
            raise importlib.metadata.PackageNotFoundError(name)
        return "4.0.0b36"

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.delitem(sys.modules, "flash_attn.cute", raising=False)
    assert "flash-attn-4" not in records.environment()["versions"]
    monkeypatch.setitem(sys.modules, "flash_attn.cute", types.ModuleType("flash_attn.cute"))
    versions = records.environment()["versions"]
    assert versions["flash-attn-4"] == "4.0.0b36"
    assert "nvidia-cutlass-dsl" not in versions
    monkeypatch.setitem(sys.modules, "cutlass", types.ModuleType("cutlass"))
    assert "nvidia-cutlass-dsl" not in records.environment()["versions"]  # imported, but not installed
