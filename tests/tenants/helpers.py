"""Fixtures and helpers of the tenant tests: Daphne processes on the shared stack's Redis (so
the shared worker serves them) with a database that this test process also opens through
Django's ORM, to create tenants and keys and to read usage as an operator would."""
from __future__ import annotations

from http.client import HTTPConnection
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.webapp.serving_stack import MODEL, Stack, http


@pytest.fixture(scope="module")
def orm(stack):
    """Django in this process, on the tenant tests' database (migrated), publishing to the stack's Redis."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)
    from tenants import shares

    shares.use_redis(stack.redis_url)
    return Path(settings.DATABASES["default"]["NAME"])


def web(stack, orm, tmp_path_factory, name: str, **env: str) -> Stack:
    """A Daphne (no worker of its own) on the shared Redis and the ORM's database."""
    return Stack(tmp_path_factory.mktemp(name), 0, redis_url=stack.redis_url, TESSERA_DB_PATH=str(orm), **env)


@pytest.fixture(scope="module")
def tenant_web(stack, orm, tmp_path_factory):
    s = web(stack, orm, tmp_path_factory, "tenant-web")
    yield s
    s.stop()


def make_tenant(**fields: Any):
    """A new active tenant with a unique slug."""
    from tenants.models import Tenant

    slug = fields.pop("slug", None) or f"t-{uuid.uuid4().hex[:8]}"
    return Tenant.objects.create(slug=slug, name=slug, **fields)


def completion(base_url: str, headers: dict | None = None, max_tokens: int = 2, prompt: str = "Hello",
               **body: Any) -> tuple[int, dict[str, str], dict]:
    status, response_headers, raw = http("POST", base_url + "/v1/completions",
                                         {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **body},
                                         headers=headers)
    return status, response_headers, json.loads(raw) if raw else {}


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def usage_totals(tenant) -> dict[str, int]:
    """The tenant's usage summed over models and hours."""
    from django.db.models import Sum

    from tenants.models import Usage

    fields = ["requests", "prompt_tokens", "completion_tokens", "errors_invalid_request", "errors_rate_limited",
              "errors_unavailable", "errors_aborted", "errors_internal"]
    sums = Usage.objects.filter(tenant=tenant).aggregate(**{f: Sum(f) for f in fields})
    return {f: sums[f] or 0 for f in fields}


def wait_for(condition, timeout: float = 15.0, interval: float = 0.1):
    """Poll ``condition()`` until it returns something truthy; returns it (fails after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(interval)


def wait_usage(tenant, requests: int) -> dict[str, int]:
    """The tenant's usage totals once ``requests`` requests are recorded."""
    return wait_for(lambda: (lambda u: u if u["requests"] >= requests else None)(usage_totals(tenant)))


class HeldStream:
    """A streaming completion held open after its first event; ``close()`` disconnects (an abort)."""

    def __init__(self, base_url: str, headers: dict[str, str], max_tokens: int = 200) -> None:
        host, port = base_url.removeprefix("http://").split(":")
        self.conn = HTTPConnection(host, int(port), timeout=60)
        body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True}
        self.conn.request("POST", "/v1/completions", json.dumps(body),
                          {"Content-Type": "application/json", **headers})
        self.response = self.conn.getresponse()
        self.status = self.response.status
        self.first = None
        if self.status == 200:
            while self.first is None:
                line = self.response.readline()
                assert line, "stream ended before its first event"
                if line.startswith(b"data: "):
                    self.first = json.loads(line[6:])

    def read_all(self) -> list[str]:
        events = []
        while line := self.response.readline():
            if line.startswith(b"data: "):
                events.append(line[6:].rstrip(b"\r\n").decode())
        return events

    def close(self) -> None:
        self.conn.close()
