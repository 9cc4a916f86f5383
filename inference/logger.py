"""The engine's logging set-up: INFO lines on stderr in vLLM's format, unless the host application
configures logging itself (set ``TESSERA_CONFIGURE_LOGGING=0``) or sets ``TESSERA_LOGGING_LEVEL``."""
from __future__ import annotations

import logging
import os

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"


def configure_default_logging() -> None:
    """Attach one stderr handler to the ``inference`` logger (idempotent)."""
    if os.environ.get("TESSERA_CONFIGURE_LOGGING", "1") == "0":
        return
    root = logging.getLogger("inference")
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(os.environ.get("TESSERA_LOGGING_LEVEL", "INFO").upper())
    root.propagate = False
