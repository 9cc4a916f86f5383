"""Channels consumers: live engine stats over a WebSocket (``/ws/stats``)."""
from __future__ import annotations

import asyncio

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from webapp.serving.client import get_redis
from webapp.serving.registry import HEARTBEAT_INTERVAL, live_workers


class LiveStatsConsumer(AsyncJsonWebsocketConsumer):
    """Pushes ``{"workers": [{"id", "model", "stats"}]}`` every heartbeat interval until the
    client closes."""

    async def connect(self) -> None:
        await self.accept()
        self._pusher = asyncio.ensure_future(self._push())

    async def disconnect(self, code: int) -> None:
        self._pusher.cancel()

    async def _push(self) -> None:
        while True:
            workers = await live_workers(get_redis())
            await self.send_json({"workers": [{"id": w["id"], "model": w["model"], "stats": w["stats"]}
                                              for w in workers]})
            await asyncio.sleep(HEARTBEAT_INTERVAL)
