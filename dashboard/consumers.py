"""``/ws/stats``: the dashboard's live numbers over a WebSocket.

Logged-in users only (Channels' session authentication): an anonymous connection is accepted
and closed at once with code ``4401``, so the page knows to send the user to the login page
instead of reconnecting. On connect the consumer sends a snapshot, then one each time the
process's :class:`~dashboard.stats_poller.StatsPoller` reads what the workers published (twice a
second), cut to what the user may see (:mod:`dashboard.access`).
"""
from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from .access import Viewer, viewer_for, visible_snapshot
from .stats_poller import State, StatsPoller, stats_poller

UNAUTHENTICATED = 4401  # close code: log in first (4000-4999 are the application's)


class LiveStatsConsumer(AsyncJsonWebsocketConsumer):
    """Sends ``dashboard.access.visible_snapshot`` JSON on connect and on every new sample."""

    # The stream comes from the process's StatsPoller, never from the channel layer: without an
    # alias the consumer does not hold a Redis BZPOPMIN per socket, whose cancellation redis-py
    # can swallow (redis/redis-py#2028), leaving a closed socket's task running.
    channel_layer_alias = None
    viewer: Viewer | None = None
    poller: StatsPoller | None = None

    async def connect(self) -> None:
        await self.accept()
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=UNAUTHENTICATED)
            return
        self.viewer = await database_sync_to_async(viewer_for)(user)
        self.poller = stats_poller()
        await self.send_state(await self.poller.latest())
        self.poller.subscribe(self.send_state)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs) -> None:
        """The stream is one-way: whatever a client sends (JSON or not) is ignored, never decoded."""

    async def disconnect(self, code: int) -> None:
        if self.poller is not None:
            self.poller.unsubscribe(self.send_state)

    async def send_state(self, state: State) -> None:
        await self.send_json(visible_snapshot(state, self.viewer))
