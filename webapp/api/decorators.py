"""``api_view``: method check, API key, tenant, and errors always in OpenAI's envelope."""
from __future__ import annotations

import functools
import hmac
import logging
from typing import Awaitable, Callable

from django.conf import settings
from redis.exceptions import RedisError
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from tenants.services import TenantNotFound, resolve_tenant

from .errors import APIError, unavailable

logger = logging.getLogger(__name__)


def _check_api_key(request: HttpRequest) -> None:
    key = settings.TESSERA.get("API_KEY")
    if not key:
        return
    header = request.headers.get("Authorization", "")
    given = header[7:] if header.startswith("Bearer ") else ""
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise APIError("Invalid API key: pass it as 'Authorization: Bearer <key>'.", 401,
                       type="invalid_request_error", code="invalid_api_key")


def api_view(*methods: str, authenticate: bool = True) -> Callable:
    """Wrap an async view ``view(request, tenant)`` of the API.

    ``authenticate``: check the API key (when one is set) and resolve the ``X-Tenant-ID``
    tenant (the default tenant when absent; 404 ``tenant not found`` when unknown).
    """
    def decorate(view: Callable[..., Awaitable[HttpResponse]]) -> Callable[..., Awaitable[HttpResponse]]:
        @csrf_exempt
        @functools.wraps(view)
        async def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            try:
                if request.method not in methods:
                    raise APIError(f"Method {request.method} is not allowed; use {' or '.join(methods)}.", 405,
                                   code="method_not_allowed")
                tenant = None
                if authenticate:
                    _check_api_key(request)
                    try:
                        tenant = await resolve_tenant(request.headers.get("X-Tenant-ID"))
                    except TenantNotFound as error:
                        raise APIError(f"tenant not found: '{error.slug}'", 404, param="X-Tenant-ID",
                                       code="tenant_not_found") from None
                return await view(request, tenant, *args, **kwargs)
            except APIError as error:
                return error.response()
            except RedisError as error:
                logger.warning("Redis failed during %s: %s", request.path, error)
                return unavailable(f"The message broker (Redis) is unavailable: {error}").response()
            except Exception:
                logger.exception("unexpected error in %s", request.path)
                return APIError("The server had an internal error.", 500, type="internal_server_error").response()

        wrapper.csrf_exempt = True
        return wrapper

    return decorate
