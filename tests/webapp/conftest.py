"""Tests on the real serving stack: redis-server on a free port, Celery engine workers with the
packaged SmolLM2, and Daphne serving the ASGI app. No mocks. The ``stack`` and ``django_app``
fixtures are in ``tests/conftest.py``, shared with ``tests/tenants`` and ``tests/dashboard``."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _model_converted(model_converted) -> None:
    """Convert the packaged model before any test here starts a process that loads it."""
