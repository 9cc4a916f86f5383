"""``TESSERA_LOGGING_LEVEL`` alone sets the engine's logging: a level, or ``off``/``none``."""
import logging

import pytest

from inference.logger import configure_default_logging


def stderr_handlers(logger):
    return [h for h in logger.handlers if type(h) is logging.StreamHandler]


@pytest.fixture
def bare_logger():
    """The ``inference`` logger with no handler yet (pytest's capture handler, added per test, removed)."""
    root = logging.getLogger("inference")
    saved = root.handlers[:], root.level, root.propagate
    yield root
    root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]


@pytest.mark.parametrize("value", ["off", "none", "OFF"])
def test_off_leaves_logging_to_the_application(bare_logger, monkeypatch, value):
    monkeypatch.setenv("TESSERA_LOGGING_LEVEL", value)
    bare_logger.handlers.clear()
    configure_default_logging()
    assert stderr_handlers(bare_logger) == []


def test_a_level_attaches_one_handler_at_that_level(bare_logger, monkeypatch):
    monkeypatch.setenv("TESSERA_LOGGING_LEVEL", "debug")
    bare_logger.handlers.clear()
    configure_default_logging()
    configure_default_logging()
    assert len(stderr_handlers(bare_logger)) == 1 and bare_logger.level == logging.DEBUG


def test_unset_is_info(bare_logger, monkeypatch):
    monkeypatch.delenv("TESSERA_LOGGING_LEVEL", raising=False)
    bare_logger.handlers.clear()
    configure_default_logging()
    assert len(stderr_handlers(bare_logger)) == 1 and bare_logger.level == logging.INFO
