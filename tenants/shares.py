"""Publish tenants to Redis for the engines and the other web processes.

Every save or delete of a tenant or an API key (admin, ``manage.py serve --tenant-id``,
``manage.py create_api_key``, the tenant pages) calls :func:`publish` once the transaction
commits: the active tenants' GPU shares are rewritten in Redis (the workers read them with
every heartbeat) and the tenants version is increased (web processes then drop their
cached tenants and keys). See :mod:`webapp.serving.tenant_shares` for the keys.
"""
from __future__ import annotations

import logging

import redis
from django.conf import settings
from django.db import DatabaseError, transaction

from webapp.serving.tenant_shares import encode_share
from webapp.transport.keys import SHARES_KEY, VERSION_KEY
from webapp.transport.published_hash import replace_hash

from .models import Tenant

logger = logging.getLogger(__name__)

_redis_url: str | None = None  # set by ``manage.py serve`` once its private Redis runs


def use_redis(url: str) -> None:
    """Publish to ``url`` from now on, instead of the settings' ``REDIS_URL`` (``manage.py serve``
    starts its own Redis after its settings were read)."""
    global _redis_url
    _redis_url = url


def redis_url() -> str:
    """The Redis that tenants and adapters are published to: :func:`use_redis`'s, else the settings'."""
    return _redis_url or settings.CELERY_BROKER_URL


def publish(client: redis.Redis | None = None) -> bool:
    """Write the active tenants' shares to Redis and bump the version; False when Redis is unreachable
    or the database is not migrated (logged; the next change or web start publishes again)."""
    url = redis_url()
    client = client or redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
    try:
        rows = list(Tenant.objects.filter(active=True).values_list("slug", "gpu_share", "priority"))
    except DatabaseError as error:
        logger.warning("could not read the tenants to publish their shares: %s", error)
        return False
    mapping = {slug: encode_share(share, priority) for slug, share, priority in rows}
    try:
        replace_hash(client, SHARES_KEY, VERSION_KEY, mapping)
    except redis.RedisError as error:
        logger.warning("could not publish tenant shares to Redis: %s", error)
        return False
    return True


def publish_on_commit(**_) -> None:
    """Signal receiver: publish once the current transaction (if any) has committed."""
    transaction.on_commit(publish)
