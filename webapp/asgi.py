"""ASGI entry point served by Daphne: Django's HTTP views (the API) behind a Channels router.

HTTP goes to :func:`webapp.handlers.http_application` (the API without the admin's
middleware); WebSockets to the Channels consumers of :mod:`webapp.routing`, behind Channels'
session authentication (the user logged in to the pages), an origin check against
``ALLOWED_HOSTS`` and a same-origin check (:mod:`webapp.ws_origin`).
"""
from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402

django_application = get_asgi_application()  # sets Django up

from webapp.handlers import http_application  # noqa: E402
from webapp.status_phrases import install as install_status_phrases  # noqa: E402
from webapp.ws_origin import SameOriginValidator  # noqa: E402

from webapp.routing import websocket_urlpatterns  # noqa: E402
from webapp.api.tokenization import warm_up_tokenizers  # noqa: E402
from tenants.shares import publish as publish_tenant_shares  # noqa: E402

install_status_phrases()  # "429 Too Many Requests" on the status line, not "429 Unknown Status"
warm_up_tokenizers()
publish_tenant_shares()  # the workers' GPU shares, also when Redis started empty

application = ProtocolTypeRouter({
    "http": http_application(),
    "websocket": SameOriginValidator(AllowedHostsOriginValidator(
        AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))),
})
