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


@pytest.fixture(scope="module")
def django_app(stack):
    """The real ASGI application in this process, on the shared stack's Redis."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django
    from django.test import override_settings

    django.setup()
    layers = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                          "CONFIG": {"hosts": [{"address": stack.redis_url, "socket_timeout": 30}],
                                     "capacity": 100_000}}}
    with override_settings(CELERY_BROKER_URL=stack.redis_url, CHANNEL_LAYERS=layers):
        from channels.layers import channel_layers

        channel_layers.backends.clear()
        from webapp.asgi import application

        yield application
        channel_layers.backends.clear()
