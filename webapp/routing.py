"""WebSocket routes of the ASGI app (behind session authentication, see ``webapp/asgi.py``)."""
from dashboard.routing import websocket_urlpatterns

__all__ = ["websocket_urlpatterns"]
