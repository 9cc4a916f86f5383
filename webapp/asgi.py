"""ASGI entry point served by Daphne: Django's HTTP views (the API) behind a Channels router."""
from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402

django_application = get_asgi_application()

from webapp.routing import websocket_urlpatterns  # noqa: E402
from webapp.api.tokenization import warm_up_tokenizers  # noqa: E402

warm_up_tokenizers()

application = ProtocolTypeRouter({
    "http": django_application,
    "websocket": URLRouter(websocket_urlpatterns),
})
