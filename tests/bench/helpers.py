"""Inputs shared by the benchmark harness tests."""

import os
import signal
from pathlib import Path

from harts.config import shipped_config_path


def tiny_with_vocab(directory: Path, vocab_size: int) -> str:
    """Path of a copy of the tiny model config with a smaller vocabulary (tokens beyond it are bad input)."""
    text = shipped_config_path("tiny", "models").read_text(encoding="utf-8")
    assert "vocab_size: 256" in text and "name: tiny\n" in text
    path = directory / "tiny-small-vocab.yaml"
    path.write_text(text.replace("vocab_size: 256", f"vocab_size: {vocab_size}").replace("name: tiny\n",
                                                                                        "name: tiny-small-vocab\n"))
    return str(path)


def sigterm_on_call(fn, call: int):
    """`fn`, wrapped to send this process SIGTERM just before its `call`-th call (1-based)."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signal.SIGTERM)
        return fn(*args, **kwargs)

    return wrapped
