"""WebSocket routes of the dashboard."""
from django.urls import path

from .consumers import LiveStatsConsumer

websocket_urlpatterns = [path("ws/stats", LiveStatsConsumer.as_asgi())]
