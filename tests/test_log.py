"""harts.log: one `harts: ...` line per message on the current stderr, not repeated by the root logger."""

import logging

import pytest

from harts import log


@pytest.fixture
def root_handler():
    """A root handler as an application would configure one."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger().addHandler(handler)
    yield records
    logging.getLogger().removeHandler(handler)


def test_levels_are_prefixed_once_and_the_root_sees_nothing(capsys, root_handler):
    logger = logging.getLogger("harts.training.loop")
    logger.info("resuming run from step 3")
    logger.warning("W&B logging stopped (RuntimeError: no network)")
    logger.error("step 0 harts: boom")
    assert capsys.readouterr().err == ("harts: resuming run from step 3\n"
                                       "harts: warning: W&B logging stopped (RuntimeError: no network)\n"
                                       "harts: error: step 0 harts: boom\n")
    assert root_handler == []


def test_debug_is_silent_and_the_level_is_the_users(capsys):
    logger = logging.getLogger("harts.bench")
    logger.debug("details")
    logging.getLogger("harts").setLevel(logging.WARNING)
    try:
        logger.info("a note")
        logger.warning("a warning")
    finally:
        logging.getLogger("harts").setLevel(logging.INFO)
    assert capsys.readouterr().err == "harts: warning: a warning\n"


def test_propagate_to_root_hands_records_to_the_application(capsys, root_handler):
    harts_logger = logging.getLogger("harts")
    handlers = list(harts_logger.handlers)
    try:
        log.propagate_to_root()
        logging.getLogger("harts.api").warning("once")
    finally:
        harts_logger.handlers[:] = handlers
        harts_logger.propagate = False
    assert capsys.readouterr().err == ""
    assert [record.getMessage() for record in root_handler] == ["once"]
