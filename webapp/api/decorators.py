"""``api_view``: method check, tenant identification, and errors always in OpenAI's envelope."""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import Awaitable, Callable

from redis.exceptions import RedisError
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from tenants.errors import TenantError
from tenants.identity import identify
from tenants.metering import Meter, error_kind
from tenants.usage import recorder

from .errors import APIError, queue_unreachable

logger = logging.getLogger(__name__)


def api_view(*methods: str, authenticate: bool = True, metered: bool = False) -> Callable:
    """Wrap an async view ``view(request, caller)`` of the API.

    ``authenticate``: identify the tenant from ``Authorization`` and ``X-Tenant-ID``
    (``tenants.identity.identify``: 401, 403 or 404 when refused); the view gets the
    ``tenants.identity.Caller`` (None without ``authenticate``).
    ``metered`` (generation endpoints): the view gets a ``tenants.metering.Meter`` of the
    caller instead, and a request that fails before its generation accounts for itself is
    counted in the tenant's usage as an error of its kind.
    A view that answers GET also answers HEAD (RFC 9110 §9.3.2): the GET's status and headers, no
    body. Daphne sends whatever body a view returns, so the body is dropped here.
    """
    if "GET" in methods and "HEAD" not in methods:
        methods = (*methods, "HEAD")

    def decorate(view: Callable[..., Awaitable[HttpResponse]]) -> Callable[..., Awaitable[HttpResponse]]:
        @csrf_exempt
        @functools.wraps(view)
        async def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            response = await answer(request, *args, **kwargs)
            if request.method == "HEAD" and not response.streaming:
                length = len(response.content)
                response.content = b""
                response["Content-Length"] = str(length)
            return response

        async def answer(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            meter = None
            try:
                if request.method not in methods:
                    raise APIError(f"Method {request.method} is not allowed; use {' or '.join(methods)}.", 405,
                                   code="method_not_allowed", allow=methods)
                caller = None
                if authenticate:
                    caller = await identify(_utf8_header(request.headers.get("Authorization", "")),
                                            _utf8_header(request.headers.get("X-Tenant-ID")))
                if metered:
                    meter = Meter(caller)
                    return await view(request, meter, *args, **kwargs)
                return await view(request, caller, *args, **kwargs)
            except asyncio.CancelledError:  # the client left (Django cancels the view): an aborted request
                if meter is not None:
                    meter.finish(error="aborted")
                raise
            except TenantError as error:
                if metered and meter is None and error.tenant_id is not None:  # refused before a Caller existed
                    recorder.record(error.tenant_id, "", 0, 0, error_kind(error.status), error.key_id)
                return _refused(meter, APIError.from_tenant(error))
            except APIError as error:
                return _refused(meter, error)
            except RequestDataTooBig:
                return _refused(meter, APIError(
                    f"The request body is too large: the limit is {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes.", 413,
                    code="request_too_large"))
            except RedisError as error:
                logger.warning("Redis failed during %s: %s", request.path, error)
                return _refused(meter, queue_unreachable())
            except Exception:
                logger.exception("unexpected error in %s", request.path)
                return _refused(meter, APIError("The server had an internal error.", 500,
                                                type="internal_server_error"))

        wrapper.csrf_exempt = True
        return wrapper

    return decorate


def _utf8_header(value: str | None) -> str | None:
    """A header value as the client wrote it: ASGI servers hand Django the raw bytes, which it decodes
    as Latin-1, so UTF-8 text (a non-ASCII tenant name or key) would show garbled in error messages."""
    if value is None:
        return None
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


def _refused(meter: Meter | None, error: APIError) -> HttpResponse:
    if meter is not None:
        meter.finish(error=error_kind(error.status))
    return error.response()
