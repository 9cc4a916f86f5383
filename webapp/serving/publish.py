"""Send many Channels messages in one Redis round trip.

``channels_redis`` sends one message per call (four commands each). A worker publishes the
coalesced deltas of a whole engine step at once, so it writes them here with a single
pipeline in the layer's own storage format (its serializer, key names and expiry), which
the layer's ``receive`` in the web process reads unchanged.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from channels_redis.core import RedisChannelLayer

_last_score = 0.0


def _next_score() -> float:
    """Strictly increasing sorted-set scores, so messages of one key keep their send order."""
    global _last_score
    _last_score = max(time.time(), _last_score + 1e-6)
    return _last_score


async def bulk_send(layer: RedisChannelLayer, items: list[tuple[str, dict[str, Any]]],
                    extra_commands: list[tuple[str, tuple, dict]] | None = None) -> None:
    """Send ``(channel, message)`` pairs; messages to one channel arrive in list order.

    Must run on the event loop that owns the layer's connections in this thread.
    ``extra_commands`` (``(method, args, kwargs)`` on the Redis client) ride in the same pipeline.
    The layer's per-channel capacity is not checked (the settings size it for all streams).
    """
    by_index: dict[int, dict[bytes | str, dict[bytes, float]]] = defaultdict(lambda: defaultdict(dict))
    for channel, message in items:
        key_name = channel
        if "!" in channel:
            message = dict(message, __asgi_channel__=channel)
            key_name = layer.non_local_name(channel)
        index = layer.consistent_hash(key_name) if "!" in channel else 0
        by_index[index][layer.prefix + key_name][layer.serialize(message)] = _next_score()
    if not by_index and extra_commands:
        by_index[0] = {}
    expiry = int(layer.expiry)
    for index, keys in by_index.items():
        pipe = layer.connection(index).pipeline(transaction=False)
        for key, members in keys.items():
            pipe.zremrangebyscore(key, min=0, max=int(time.time()) - expiry)
            pipe.zadd(key, members)
            pipe.expire(key, expiry)
        if index == 0:
            for method, args, kwargs in extra_commands or ():
                getattr(pipe, method)(*args, **kwargs)
        await pipe.execute()
