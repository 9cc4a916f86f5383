"""Same-origin check for WebSocket handshakes.

Browsers send the page's ``Origin`` with a WebSocket handshake, and the session cookie with it
whatever page opened the socket. Without a check, a page on another site could open
``/ws/stats`` with a logged-in user's cookie and read the live metrics (cross-site WebSocket
hijacking). ``ALLOWED_HOSTS = ["*"]`` (the development default) makes Channels' own
``AllowedHostsOriginValidator`` accept every origin, so this middleware also requires the
origin's host and port to equal the handshake's ``Host`` header. Handshakes without an
``Origin`` (clients other than browsers, which send no cookie of the user's) pass.
"""
from __future__ import annotations

from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier


def same_origin(headers: dict[bytes, bytes]) -> bool:
    """Whether the handshake's ``Origin`` (if any) names the host and port of its ``Host`` header."""
    origin = headers.get(b"origin")
    if origin is None:
        return True
    netloc = urlsplit(origin.decode("latin-1")).netloc.lower()
    return bool(netloc) and netloc == headers.get(b"host", b"").decode("latin-1").lower()


class SameOriginValidator:
    """ASGI middleware: refuses (HTTP 403 at the handshake) a WebSocket whose origin is another site."""

    def __init__(self, application) -> None:
        self.application = application

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and not same_origin(dict(scope.get("headers", ()))):
            return await WebsocketDenier()(scope, receive, send)
        return await self.application(scope, receive, send)
