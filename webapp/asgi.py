"""ASGI entry point served by Daphne: Django's HTTP views (the API) behind a Channels router.

HTTP goes to :func:`webapp.handlers.http_application` (the API without the admin's
middleware); WebSockets to the Channels consumers of :mod:`webapp.routing`, behind Channels'
session authentication (the user logged in to the pages), an origin check against
``ALLOWED_HOSTS`` and a same-origin check (:mod:`webapp.ws_origin`).

Daphne imports this module once per web process; :func:`build_application` sets Django up and
runs the process's start-up (:mod:`webapp.startup` says what and why there) before it serves.
"""
from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

import django  # noqa: E402
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402


def build_application() -> ProtocolTypeRouter:
    """Set Django up, start this web process (:func:`webapp.startup.start_web_process`) and
    return the protocol router. Call once per process."""
    django.setup(set_prefix=False)  # as django.core.asgi.get_asgi_application() does
    from webapp.handlers import http_application  # noqa: PLC0415 (after django.setup())
    from webapp.routing import websocket_urlpatterns  # noqa: PLC0415
    from webapp.startup import start_web_process  # noqa: PLC0415
    from webapp.ws_origin import SameOriginValidator  # noqa: PLC0415

    start_web_process()
    return ProtocolTypeRouter({
        "http": http_application(),
        "websocket": SameOriginValidator(AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))),
    })


application = build_application()
