"""Fixtures shared by the packages whose tests run the real serving stack (``tests/webapp``,
``tests/tenants``, ``tests/dashboard``): the stack itself, started once per test run whichever
packages use it, and the ASGI application in this process. Each of those packages' conftest
converts the packaged model first (``model_converted``); the engine tests (``tests/inference``)
use none of this, and nothing here is imported until a fixture runs (the GPU machine runs them
without Redis or the packaged model)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.webapp.serving_stack import Stack

ENGINE_TESTS = Path(__file__).parent / "inference"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the engine tests first, as when the stack's packages all sat in ``tests/webapp``: the
    shared stack starts at its first use and runs to the end, and need not idle through them."""
    items.sort(key=lambda item: ENGINE_TESTS not in item.path.parents)


# Django set up inside the test process (in-process tests) gets a database of its own, never
# the repository's db.sqlite3; settings read this once, at the first django.setup().
os.environ.setdefault("TESSERA_DB_PATH", os.path.join(tempfile.mkdtemp(prefix="tessera-tests-"), "db.sqlite3"))


@pytest.fixture(scope="session")
def model_converted() -> None:
    """The packaged model, converted once, before any process needs it."""
    from inference.model_loader import resolve_model
    from tests.webapp.serving_stack import MODEL

    resolve_model(MODEL)


@pytest.fixture(scope="session")
def stack(tmp_path_factory, model_converted) -> Stack:
    """The shared stack: one worker; tests must leave it serving."""
    from tests.webapp.serving_stack import Stack

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
