"""Fixtures that run the real serving stack: redis-server on a free port, Celery engine
workers with the packaged SmolLM2, and Daphne serving the ASGI app. No mocks."""
from __future__ import annotations

import os
import tempfile

import pytest

from tests.webapp.serving_stack import MODEL, Stack

# Django set up inside the test process (in-process tests) gets a database of its own, never
# the repository's db.sqlite3; settings read this once, at the first django.setup().
os.environ.setdefault("TESSERA_DB_PATH", os.path.join(tempfile.mkdtemp(prefix="tessera-tests-"), "db.sqlite3"))


@pytest.fixture(scope="session", autouse=True)
def _model_converted() -> None:
    """Convert the packaged model once, before any process needs it."""
    from inference.model_loader import resolve_model

    resolve_model(MODEL)


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    """The shared stack: one worker; tests must leave it serving."""
    s = Stack(tmp_path_factory.mktemp("stack"))
    yield s
    s.stop()
