"""The engine's logging set-up, read from one variable, ``TESSERA_LOGGING_LEVEL`` (vLLM's
``VLLM_LOGGING_LEVEL``): a level name (``INFO`` when unset; ``DEBUG``, ``WARNING``...) gives log lines
on stderr in vLLM's format at that level; ``off`` or ``none`` leaves logging to the host
application (the engine attaches no handler). ``TESSERA_CONFIGURE_LOGGING=0``, the former switch for
the latter, is no longer read: set ``TESSERA_LOGGING_LEVEL=off`` instead."""
from __future__ import annotations

import logging
import os

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
LOGGING_OFF = ("off", "none")  # TESSERA_LOGGING_LEVEL values that leave logging to the application


def configure_default_logging() -> None:
    """Attach one stderr handler to the ``inference`` logger at ``TESSERA_LOGGING_LEVEL`` (idempotent;
    nothing when it is ``off`` or ``none``).

    Raises:
        ValueError: ``TESSERA_LOGGING_LEVEL`` is not a level name (nor ``off``/``none``).
    """
    level = os.environ.get("TESSERA_LOGGING_LEVEL", "INFO").strip()
    if level.lower() in LOGGING_OFF:
        return
    root = logging.getLogger("inference")
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False
