"""harts.bench.records.sigterm_raises: SIGTERM as an exception, once, and the handler restored."""

import os
import signal

import pytest

from harts.bench.records import Terminated, sigterm_raises


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
