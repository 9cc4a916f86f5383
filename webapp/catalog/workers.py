"""The admin's side of worker management: mirror the heartbeats into ``Worker`` rows, and
send model commands (:mod:`webapp.serving.commands`) to chosen workers."""
from __future__ import annotations

import datetime as dt

import redis
from django.conf import settings
from django.db import transaction

from webapp.serving import worker_registry
from webapp.serving.commands import ModelCommand, send_command

from .models import Worker

OFFLINE_KEPT = dt.timedelta(hours=1)  # a worker that stopped stays listed (offline) this long


def redis_client() -> redis.Redis:
    """A synchronous client of the deployment's Redis."""
    return redis.Redis.from_url(settings.CELERY_BROKER_URL, socket_timeout=5, socket_connect_timeout=2)


def sync_workers(client: redis.Redis | None = None) -> list[dict]:
    """Refresh the ``Worker`` rows from the live heartbeats: live workers are written as they
    are, workers that stopped are marked offline and deleted after ``OFFLINE_KEPT``.
    Returns the live heartbeats.

    Raises:
        redis.RedisError: Redis is unreachable (the rows are left as they were).
    """
    infos = worker_registry.all_workers(client or redis_client())
    now = dt.datetime.now(dt.timezone.utc)
    with transaction.atomic():
        for info in infos:
            Worker.objects.update_or_create(worker_id=info["id"], defaults={
                "host": info.get("host", ""), "pid": info.get("pid"), "device": info.get("device", ""),
                "memory_used_bytes": info.get("memory_used_bytes"),
                "memory_total_bytes": info.get("memory_total_bytes"),
                "model": info.get("model") or info.get("loading") or "", "state": info.get("state", Worker.READY),
                "error": info.get("error") or "",
                "last_heartbeat": dt.datetime.fromtimestamp(info.get("time", now.timestamp()), dt.timezone.utc)})
        gone = Worker.objects.exclude(worker_id__in=[i["id"] for i in infos])
        gone.filter(last_heartbeat__lt=now - OFFLINE_KEPT).delete()
        gone.exclude(state=Worker.OFFLINE).update(state=Worker.OFFLINE)
    return infos


def command_workers(workers, command: ModelCommand, client: redis.Redis | None = None) -> int:
    """Send ``command`` to each of ``workers`` (``Worker`` rows); returns how many got it."""
    client = client or redis_client()
    for worker in workers:
        send_command(client, worker.worker_id, command)
    return len(workers)
