"""Usage accounting: per tenant, model and UTC hour, from the tokens requests actually used.

Web processes record each request when it ends (``record``); a background task of the
event loop writes what piled up, one transaction per tenant, model and hour (one
``UPDATE ... SET x = x + n`` each), so the response never waits for the database and a burst of
requests costs a few writes. Keys' ``last_used_at`` is written at most once a minute per key
and process. What is still queued when a web process is killed is lost (at most one write).
"""
from __future__ import annotations

import asyncio
import datetime as dt
import logging
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async
from django.db import IntegrityError, transaction
from django.db.models import F, Sum

from .models import ERROR_KINDS, ApiKey, Tenant, Usage

logger = logging.getLogger(__name__)

LAST_USED_EVERY = dt.timedelta(seconds=60)


@dataclass
class _Counts:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def fields(self) -> dict[str, int]:
        values = {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                  "completion_tokens": self.completion_tokens}
        values.update({f"errors_{kind}": n for kind, n in self.errors.items()})
        return {name: n for name, n in values.items() if n}


class UsageRecorder:
    """Collects finished requests and writes them in the background (one recorder per process)."""

    def __init__(self) -> None:
        self._pending: dict[tuple[int, str, dt.datetime], _Counts] = {}
        self._key_uses: dict[int, dt.datetime] = {}
        self._key_written: dict[int, dt.datetime] = {}
        self._task: asyncio.Task | None = None

    def record(self, tenant_id: int, model: str, prompt_tokens: int, completion_tokens: int,
               error: str | None = None, key_id: int | None = None) -> None:
        """Count one request (call on the event loop).

        Raises:
            ValueError: ``error`` is not one of ``models.ERROR_KINDS``.
        """
        if error is not None and error not in ERROR_KINDS:
            raise ValueError(f"error kind must be one of {ERROR_KINDS}, got {error!r}")
        now = dt.datetime.now(dt.timezone.utc)
        hour = now.replace(minute=0, second=0, microsecond=0)
        counts = self._pending.setdefault((tenant_id, model, hour), _Counts())
        counts.requests += 1
        counts.prompt_tokens += prompt_tokens
        counts.completion_tokens += completion_tokens
        if error is not None:
            counts.errors[error] = counts.errors.get(error, 0) + 1
        if key_id is not None and now - self._key_written.get(key_id, dt.datetime.min.replace(
                tzinfo=dt.timezone.utc)) >= LAST_USED_EVERY:
            self._key_uses[key_id] = now
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def flush(self) -> None:
        """Wait until everything recorded so far is written."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _drain(self) -> None:
        while self._pending or self._key_uses:
            batch, self._pending = self._pending, {}
            key_uses, self._key_uses = self._key_uses, {}
            self._key_written.update(key_uses)
            try:
                await sync_to_async(_write, thread_sensitive=True)(batch, key_uses)
            except Exception:
                logger.exception("writing usage of %d tenant-hours failed", len(batch))


def _write(batch: dict[tuple[int, str, dt.datetime], _Counts], key_uses: dict[int, dt.datetime]) -> None:
    # One transaction per tenant-hour, so that one that fails (its tenant deleted meanwhile: SQLite
    # checks foreign keys at the commit) loses nothing of the others; a deleted tenant's usage goes
    # with it.
    alive = set(Tenant.objects.filter(id__in={tenant_id for tenant_id, _, _ in batch}).values_list("id", flat=True))
    for (tenant_id, model, hour), counts in batch.items():
        if tenant_id not in alive:
            continue
        increments = {name: F(name) + n for name, n in counts.fields().items()}
        for attempt in range(2):  # a row another process created meanwhile: add to it
            try:
                with transaction.atomic():
                    rows = Usage.objects.filter(tenant_id=tenant_id, model=model, hour=hour)
                    if not rows.update(**increments):
                        Usage.objects.create(tenant_id=tenant_id, model=model, hour=hour, **counts.fields())
                break
            except IntegrityError:
                if attempt:
                    logger.warning("usage of tenant %d (%s, %s) not written: the tenant is gone", tenant_id, model,
                                   hour.isoformat())
    for key_id, when in key_uses.items():
        ApiKey.objects.filter(id=key_id).update(last_used_at=when)  # update(): no signal, no cache flush


recorder = UsageRecorder()


def tokens_since(tenant_id: int, since: dt.datetime) -> int:
    """Prompt plus completion tokens recorded for the tenant in the hours from ``since`` on (database
    access: call from a thread)."""
    totals = Usage.objects.filter(tenant_id=tenant_id, hour__gte=since).aggregate(
        prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"))
    return (totals["prompt"] or 0) + (totals["completion"] or 0)
