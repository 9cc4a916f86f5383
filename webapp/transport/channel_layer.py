"""channels-redis's storage format, where Tessera reads or writes it itself: the channel names, many
Channels messages sent in one Redis round trip, and a web process's reading of its reply channels.

``channels_redis`` sends one message per call (four commands each). A worker publishes the
coalesced deltas of a whole engine step at once: here, all messages for the channels of one
web process (which share one Redis key) become a single *batch* message addressed to all of
them, the way the layer's own ``group_send`` addresses one message to many channels. It is
written with one pipeline in the layer's storage format (serializer, key names, expiry);
the web process reads it with :class:`webapp.serving.replies.ReplyRouter` (:func:`pop_group`,
:func:`unpack`), which hands each channel its own messages.
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


BATCH_TYPE = "tessera.batch"
REPLY_CHANNEL_PREFIX = "tessera.reply"  # a web process's reply channels: tessera.reply.<client prefix>!<id>
CONTROL_CHANNEL_PREFIX = "tessera.worker"  # a worker's control channel (aborts)


async def bulk_send(layer: RedisChannelLayer, items: list[tuple[str, dict[str, Any]]],
                    extra_commands: list[tuple[str, tuple, dict]] | None = None) -> None:
    """Send ``(channel, message)`` pairs; messages to one channel arrive in list order.

    Process-specific channels (``name!suffix``) of one process get one batch message
    (see :func:`unpack`); other channels get one message each. Must run on the
    event loop that owns the layer's connections in this thread. ``extra_commands``
    (``(method, args, kwargs)`` on the Redis client) ride in the same pipeline. The layer's
    per-channel capacity is not checked (the settings size it for all streams).
    """
    batches: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    members: dict[int, dict[str, dict[bytes, float]]] = defaultdict(lambda: defaultdict(dict))
    for channel, message in items:
        if "!" in channel:
            batches[layer.non_local_name(channel)][channel].append(message)
        else:
            members[0][layer.prefix + channel][layer.serialize(message)] = _next_score()
    for key_name, by_channel in batches.items():
        batch = {"type": BATCH_TYPE, "messages": dict(by_channel)}
        members[layer.consistent_hash(key_name)][layer.prefix + key_name][layer.serialize(batch)] = _next_score()
    if not members and extra_commands:
        members[0] = {}
    expiry = int(layer.expiry)
    for index, keys in members.items():
        pipe = layer.connection(index).pipeline(transaction=False)
        for key, scored in keys.items():
            pipe.zremrangebyscore(key, min=0, max=int(time.time()) - expiry)
            pipe.zadd(key, scored)
            pipe.expire(key, expiry)
        if index == 0:
            for method, args, kwargs in extra_commands or ():
                getattr(pipe, method)(*args, **kwargs)
        await pipe.execute()


def group_key(layer: RedisChannelLayer, group: str) -> tuple[int, str]:
    """``(connection index, Redis key)`` of the sorted set that holds the messages of every
    process-specific channel whose name starts with ``group`` (``name!``)."""
    return layer.consistent_hash(group), layer.prefix + group


async def pop_group(layer: RedisChannelLayer, index: int, key: str, timeout: float) -> dict[str, Any] | None:
    """The oldest message of :func:`group_key`'s set, waiting up to ``timeout`` seconds (None when
    none came).

    Raises:
        RedisError: Redis could not be reached.
    """
    popped = await layer.connection(index).bzpopmin(key, timeout=timeout)
    return None if popped is None else layer.deserialize(popped[1])


def unpack(message: dict[str, Any]) -> list[tuple[str | None, list[dict[str, Any]]]]:
    """``(channel, messages)`` pairs of one message read by :func:`pop_group`: a batch of
    :func:`bulk_send`, or one message sent with the layer's own ``send``."""
    if message.get("type") == BATCH_TYPE:
        return list(message["messages"].items())
    return [(message.pop("__asgi_channel__", None), [message])]
