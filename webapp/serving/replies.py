"""Reply channels of a web process: one reader hands every worker message to its stream.

Workers write the deltas for all reply channels of one web process into one Redis sorted
set, in the Channels layer's storage format (:mod:`webapp.transport.channel_layer`). The layer's own
``receive`` would cost every stream two tasks and a lock per message, and every message
four Redis round trips (a Lua clean-up, ``BZPOPMIN``, then adding to and removing from a
backup set that protects against a receiver dying mid-way; pointless here, as a reply
channel lives and dies with its process). Instead one task per event loop pops the set with
``BZPOPMIN`` and calls the sink registered for each message's channel; messages for a
channel nobody holds any more (its stream ended) are dropped.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Callable

from channels.layers import get_channel_layer
from redis.exceptions import RedisError

from webapp.transport.channel_layer import REPLY_CHANNEL_PREFIX, group_key, pop_group, unpack

logger = logging.getLogger(__name__)

READ_TIMEOUT = 5  # seconds one BZPOPMIN blocks (below the layer's 30 s socket timeout)
RETRY_DELAY = 0.5  # seconds before reading again after a Redis error
CLOSE_GRACE = 1.0  # seconds :meth:`ReplyRouter.aclose` waits for a cancelled read to end

Sink = Callable[[list[dict[str, Any]]], None]


class ReplyRouter:
    """Reply channels of this process on one event loop, and the task that reads them.

    Channel names have the layer's format for process-specific channels
    (``tessera.reply.<client prefix>!<id>``), so :func:`webapp.transport.channel_layer.bulk_send` batches all
    messages for this process into one sorted-set member.
    """

    def __init__(self, layer: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.layer = layer
        self.loop = loop  # held, so that its id (the key in ``_routers``) is never reused
        self.group = f"{REPLY_CHANNEL_PREFIX}.{layer.client_prefix}!"  # the part all reply channels share
        self._index, self._key = group_key(layer, self.group)
        self._sinks: dict[str, Sink] = {}
        self._reader: asyncio.Task | None = None
        self._closed = False

    def open(self, sink: Sink) -> str:
        """A new reply channel whose messages go to ``sink`` (called on the event loop with
        each batch of messages for it, in send order; it must not block)."""
        if self._closed:
            raise RuntimeError("this reply router is closed")
        channel = self.group + uuid.uuid4().hex
        self._sinks[channel] = sink
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._read())
        return channel

    def close(self, channel: str) -> None:
        """Stop delivering to ``channel`` (later messages for it are dropped)."""
        self._sinks.pop(channel, None)

    async def aclose(self) -> None:
        """Stop the reader task and wait until it has ended; later :meth:`open` calls raise
        ``RuntimeError``.

        A cancelled blocking read does not always end: redis-py can swallow the cancellation and
        go on waiting for a reply that never comes. When the read has not ended within
        :data:`CLOSE_GRACE` seconds, the connections of this router's Redis client are closed,
        which ends it with a ``ConnectionError``.
        """
        self._closed = True
        reader, self._reader = self._reader, None
        if reader is None or reader.done():
            return
        reader.cancel()
        _, pending = await asyncio.wait({reader}, timeout=CLOSE_GRACE)
        if pending:
            await self.layer.connection(self._index).connection_pool.disconnect()
            await asyncio.wait(pending)

    async def _read(self) -> None:
        while not self._closed:
            try:
                message = await pop_group(self.layer, self._index, self._key, READ_TIMEOUT)
            except RedisError as error:
                if self._closed:
                    return
                logger.warning("reading reply channels failed: %s", error)
                await asyncio.sleep(RETRY_DELAY)
                continue
            if message is not None:
                self._dispatch(message)

    def _dispatch(self, message: dict[str, Any]) -> None:
        for channel, messages in unpack(message):
            sink = self._sinks.get(channel)
            if sink is not None:
                try:
                    sink(messages)
                except Exception:  # one broken stream must not stop the others' deliveries
                    logger.exception("delivering to %s failed", channel)


_routers: dict[int, ReplyRouter] = {}


def reply_router() -> ReplyRouter:
    """This process's router for the running event loop (a new one after the last was closed)."""
    loop = asyncio.get_running_loop()
    router = _routers.get(id(loop))
    if router is None or router._closed:
        router = _routers[id(loop)] = ReplyRouter(get_channel_layer(), loop)
    return router
