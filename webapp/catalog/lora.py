"""Registering LoRA adapters (``POST /v1/load_lora_adapter``, the admin, ``manage.py lora_adapter``) and
publishing them to the workers.

The database's :class:`~.models.LoRAAdapter` rows are the registry; every save or delete rewrites its copy
in Redis for the workers (:data:`webapp.transport.keys.LORA_ADAPTERS_KEY`, read with each heartbeat) and
bumps :data:`~webapp.transport.keys.LORA_VERSION_KEY` (web processes then reload their cached adapters).
Before a row is written, a ready worker of the base model loads the adapter (:func:`check_on_ready_worker`):
a refused adapter is never registered.
"""
from __future__ import annotations

import logging

import redis
from django.db import DatabaseError, transaction

from webapp.serving import worker_registry
from webapp.serving.lora_registry import CheckResult, check_on_worker
from webapp.transport.keys import LORA_ADAPTERS_KEY, LORA_VERSION_KEY
from webapp.transport.published_hash import replace_hash

from .models import LoRAAdapter

logger = logging.getLogger(__name__)


def publish(client: redis.Redis | None = None) -> bool:
    """Write every registered adapter to Redis and bump the version; False when Redis is unreachable or the
    database is not migrated (logged; the next change, or a web process that finds Redis emptied, publishes
    again)."""
    from tenants import shares  # noqa: PLC0415 - the URL serve's private Redis runs at

    url = shares.redis_url()
    client = client or redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
    try:
        mapping = {a.name: a.entry().encode() for a in LoRAAdapter.objects.select_related("tenant")}
    except DatabaseError as error:
        logger.warning("could not read the LoRA adapters to publish them: %s", error)
        return False
    try:
        replace_hash(client, LORA_ADAPTERS_KEY, LORA_VERSION_KEY, mapping)
    except redis.RedisError as error:
        logger.warning("could not publish the LoRA adapters to Redis: %s", error)
        return False
    return True


def startup_clashes(served_names, startup_names) -> list[str]:
    """Why ``serve`` cannot start with these served model names and ``--lora-modules`` adapters: registered
    adapters of the same names. A served model's name taken by an adapter would send that model's requests to
    the adapter; a start-up adapter's would be listed as one adapter and served as the other. Empty when the
    database cannot be read (the clash checks at registration remain)."""
    served, startup = set(served_names), set(startup_names)
    try:
        clashes = list(LoRAAdapter.objects.select_related("tenant").filter(name__in=sorted(served | startup)))
    except DatabaseError:
        return []
    problems = []
    for adapter in sorted(clashes, key=lambda a: a.name):
        owner = f"tenant {adapter.tenant.slug!r}" if adapter.tenant else "public"
        what = "the served model" if adapter.name in served else "a --lora-modules adapter"
        problems.append(f"{what} '{adapter.name}' has the name of a registered LoRA adapter ({owner}, "
                        f"{adapter.path}): rename one of them (`manage.py lora_adapter remove {adapter.name}`).")
    return problems


def publish_on_commit(**_) -> None:
    """Signal receiver: publish once the current transaction (if any) has committed."""
    transaction.on_commit(publish)


async def check_on_ready_worker(name: str, base_model: str, path: str) -> CheckResult | None:
    """Have a ready worker of ``base_model`` load adapter ``name`` from ``path`` (rank, files, shapes); its
    answer, or None when no worker of that model is ready (nothing could check it).

    Raises:
        RedisError: Redis is unreachable.
    """
    from channels.layers import get_channel_layer  # noqa: PLC0415
    from redis import asyncio as aioredis  # noqa: PLC0415

    from tenants import shares  # noqa: PLC0415

    client = aioredis.Redis.from_url(shares.redis_url())
    try:
        workers = [w for w in await worker_registry.live_workers(client, base_model) if w.get("live")]
        if not workers:
            return None
        return await check_on_worker(get_channel_layer(), client, workers[0]["control"], name, path)
    finally:
        await client.aclose()


def registration_problem(name: str, base_model: str, path: str) -> tuple[tuple[str, str] | None, bool]:
    """What refuses registering adapter ``name`` (the admin's form, ``manage.py lora_adapter add``): its name
    taken by a served model or a start-up adapter (:func:`webapp.api.adapters.name_clash`), or a ready worker
    of ``base_model`` refusing it (rank, files, shapes).

    Returns:
        ``((field, message) or None, whether a ready worker checked the adapter)``; without one, the
        workers check it when they load it.
    Raises:
        RedisError: Redis is unreachable (nothing live could be checked).
    """
    from asgiref.sync import async_to_sync  # noqa: PLC0415

    from webapp.api.adapters import name_clash  # noqa: PLC0415

    clash = async_to_sync(name_clash)(name)
    if clash:
        return ("name", clash), False
    result = async_to_sync(check_on_ready_worker)(name, base_model, path)
    if result is not None and not result.ok:
        return (("name" if result.param == "lora_name" else "path"), result.message), True
    return None, result is not None
