"""A Redis hash that web processes and workers read as one snapshot: replaced whole, with a version counter."""
from __future__ import annotations

import redis


def replace_hash(client: redis.Redis, key: str, version_key: str, mapping: dict[str, bytes]) -> None:
    """Replace hash ``key`` with ``mapping`` and bump ``version_key``, in one transaction (readers that
    cache the hash reread it when the version moves).

    Raises:
        redis.RedisError: Redis is unreachable.
    """
    with client.pipeline(transaction=True) as pipe:
        pipe.delete(key)
        if mapping:
            pipe.hset(key, mapping=mapping)
        pipe.incr(version_key)
        pipe.execute()
