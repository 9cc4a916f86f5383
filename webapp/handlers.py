"""ASGI handlers: the API without the admin's per-request thread costs.

Under ASGI, Django runs every request in its own ``ThreadSensitiveContext``: the first
thread-sensitive ``sync_to_async`` call of a request (the request_started signal's
``close_old_connections`` already is one) starts a new thread for it, and every
``MiddlewareMixin`` middleware hops to that thread twice. Together about 4 ms per request,
most of the serving path's latency budget. So the API and the index page get a handler that

* runs ``settings.API_MIDDLEWARE`` (none of the admin's session, CSRF, auth and messages
  middleware);
* uses no per-request context: thread-sensitive work (the ORM's rare, cached tenant
  lookups) runs on asgiref's one long-lived thread, which keeps its database connection;
* skips Django's per-request database housekeeping (``reset_queries`` and
  ``close_old_connections`` on the request signals, three thread hops): those receivers
  are re-connected for Django's own handlers only.

Measured on 2 CPU cores: ``GET /version`` through the ASGI app in-process went from 4.4 ms
to 2.0 ms, and through Daphne (curl) from about 6 ms to about 4 ms.

Only ``/admin/``, the tenant pages (``/tenants/``), the dashboard (``/dashboard/``) and
``/static/`` go through Django's stock handler with ``settings.MIDDLEWARE``.

At shutdown Daphne cancels every application instance. Django's handler would leave its
request task behind and the client's stream would be cut mid-way; the API handler instead
tells the request (:data:`webapp.serving.client.request_stopped`) and gives it
``STOP_GRACE`` seconds to abort its engine requests and end its stream with an error event
and ``[DONE]`` (a non-streamed answer: a 503).
"""
from __future__ import annotations

import asyncio

from django.conf import settings
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core import signals
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.wsgi import WSGIHandler
from django.db import close_old_connections, reset_queries

from webapp.serving.client import request_stopped

ADMIN_PREFIXES = ("/admin/", "/tenants/", "/dashboard/", "/" + settings.STATIC_URL.lstrip("/"))
STOP_GRACE = 3.0  # seconds a request has to end cleanly once the server stops
FLUSH_DELAY = 0.05  # seconds for the server to write what the request sent last


class APIHandler(ASGIHandler):
    """Django's ASGI handler with ``settings.API_MIDDLEWARE``, no per-request thread, and a
    clean end for requests in flight when the server stops."""

    async def __call__(self, scope, receive, send) -> None:
        stopped = asyncio.get_running_loop().create_future()
        token = request_stopped.set(stopped)
        try:
            handling = asyncio.ensure_future(self.handle(scope, receive, send))  # inherits `stopped`
        finally:
            request_stopped.reset(token)
        try:
            await asyncio.shield(handling)
        except asyncio.CancelledError:  # the server stops
            stopped.set_result(None)
            done, _ = await asyncio.wait({handling}, timeout=STOP_GRACE)
            if done:
                await asyncio.sleep(FLUSH_DELAY)
            else:
                handling.cancel()
            raise

    def load_middleware(self, is_async: bool = False) -> None:
        full = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.API_MIDDLEWARE
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = full


class PathDispatcher:
    """Send ``/admin/``, ``/tenants/``, ``/dashboard/`` and static files to the full Django stack,
    everything else to the API."""

    def __init__(self, api, admin) -> None:
        self.api = api
        self.admin = admin

    async def __call__(self, scope, receive, send):
        app = self.admin if scope["path"].startswith(ADMIN_PREFIXES) else self.api
        return await app(scope, receive, send)


def _db_housekeeping_for_django_handlers_only() -> None:
    for signal, receivers in ((signals.request_started, (reset_queries, close_old_connections)),
                              (signals.request_finished, (close_old_connections,))):
        for receiver in receivers:
            signal.disconnect(receiver)
            for sender in (ASGIHandler, WSGIHandler):
                signal.connect(receiver, sender=sender)


def http_application():
    """The HTTP side of the ASGI app (call once, after ``django.setup()``)."""
    _db_housekeeping_for_django_handlers_only()
    return PathDispatcher(APIHandler(), ASGIStaticFilesHandler(ASGIHandler()))
