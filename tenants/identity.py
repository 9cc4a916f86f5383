"""Who a request is for: ``Authorization: Bearer <key>`` and ``X-Tenant-ID: <slug>``.

Rules (docs/tenants.md says the same):

1. A tenant key (``tsk-…``) identifies its tenant. ``X-Tenant-ID``, when sent too, must
   name that tenant (else 403). A ``tsk-`` key that is unknown, revoked or expired is 401,
   never served as another tenant.
2. The deployment key (``serve --api-key``, vLLM's flag) lets the operator's clients pick any
   tenant with ``X-Tenant-ID`` (absent: ``default``).
3. Without a valid key: in key-only mode (``TESSERA_KEY_ONLY=1`` / ``serve --key-only``, or
   ``--api-key`` set) the request is 401. Otherwise (local development, or tenants that
   have no keys) ``X-Tenant-ID`` alone selects the tenant, and a request without it is the
   ``default`` tenant's; a tenant that has keys of its own cannot be selected this way (401).
   Other ``Authorization`` values (the OpenAI SDK needs *some* key, e.g. ``EMPTY``) are ignored, except a
   tenant key sent without ``Bearer``: 401, not served as the default tenant.
4. Unknown tenant: 404; inactive tenant: 403; a model the tenant may not use: 403.

Lookups are cached per process and dropped whenever the tenants version in Redis moves
(every save of a tenant or key bumps it, see :mod:`tenants.shares`), so a revoked key or an
edited limit takes effect on the next request in every web process. Key comparison: the
secret's SHA-256 is looked up by index, then compared with ``hmac.compare_digest``.
"""
from __future__ import annotations

import datetime as dt
import hmac
import time
from dataclasses import dataclass

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from webapp.serving.web_redis import get_redis
from webapp.transport.keys import VERSION_KEY

from .errors import TenantError
from .models import DEFAULT_TENANT_SLUG, KEY_PREFIX, ApiKey, Tenant, hash_secret

CACHE_MAX_AGE = 30.0  # seconds; a safety net in case Redis lost the version counter


@dataclass(frozen=True)
class Limits:
    """A tenant's gateway limits; None is no limit."""

    max_concurrent_requests: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    daily_token_budget: int | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.max_concurrent_requests, self.requests_per_minute,
                                           self.tokens_per_minute, self.daily_token_budget))


@dataclass(frozen=True)
class TenantRef:
    """What a request needs to know about its tenant: plain values, no model instance."""

    id: int
    slug: str
    active: bool = True
    has_keys: bool = False
    limits: Limits = Limits()
    allowed_models: tuple[str, ...] = ()

    def allows_model(self, model: str) -> bool:
        return not self.allowed_models or model in self.allowed_models


@dataclass(frozen=True)
class _KeyRef:
    id: int
    prefix: str
    key_hash: str
    tenant_id: int
    expires_at: dt.datetime | None
    revoked: bool


@dataclass(frozen=True)
class Caller:
    """The identified tenant of a request, and the key that identified it (None without a tenant key)."""

    tenant: TenantRef
    key_id: int | None = None

    def check_model(self, model: str) -> None:
        """Raises: TenantError 403 ``model_not_allowed`` when the tenant may not use ``model``."""
        if not self.tenant.allows_model(model):
            raise TenantError(f"Tenant '{self.tenant.slug}' may not use model '{model}'.", 403,
                              "model_not_allowed", param="model")


class _Cache:
    """Tenants by slug and id, keys by hash; valid for one tenants version."""

    def __init__(self) -> None:
        self.version: bytes | None = None
        self.loaded = 0.0
        self.by_slug: dict[str, TenantRef | None] = {}
        self.by_id: dict[int, TenantRef | None] = {}
        self.keys: dict[str, _KeyRef | None] = {}

    async def sync(self) -> None:
        version = await get_redis().get(VERSION_KEY)
        now = time.monotonic()
        if version != self.version or now - self.loaded > CACHE_MAX_AGE:
            self.version, self.loaded = version, now
            self.by_slug, self.by_id, self.keys = {}, {}, {}

    async def tenant(self, slug: str | None = None, id: int | None = None) -> TenantRef | None:
        by_slug, by_id = self.by_slug, self.by_id  # this version's (a concurrent sync may replace them)
        found = by_slug.get(slug, False) if slug is not None else by_id.get(id, False)
        if found is not False:
            return found
        rows = Tenant.objects.filter(slug=slug) if slug is not None else Tenant.objects.filter(id=id)
        tenant = await rows.afirst()
        ref = None
        if tenant is not None:
            # Any key ever issued counts, revoked and expired ones too: revoking a leaked last key
            # must not open the tenant to callers without a key.
            has_keys = await ApiKey.objects.filter(tenant_id=tenant.id).aexists()
            ref = TenantRef(tenant.id, tenant.slug, tenant.active, has_keys,
                            Limits(tenant.max_concurrent_requests, tenant.requests_per_minute,
                                   tenant.tokens_per_minute, tenant.daily_token_budget),
                            tuple(tenant.allowed_models or ()))
            by_id[tenant.id] = ref
        if slug is not None:
            by_slug[slug] = ref
        else:
            by_id[id] = ref
        return ref

    async def key(self, key_hash: str) -> _KeyRef | None:
        keys = self.keys
        found = keys.get(key_hash, False)
        if found is not False:
            return found
        row = await ApiKey.objects.filter(key_hash=key_hash).values(
            "id", "prefix", "key_hash", "tenant_id", "expires_at", "revoked_at").afirst()
        ref = None
        if row is not None:
            ref = _KeyRef(row["id"], row["prefix"], row["key_hash"], row["tenant_id"], row["expires_at"],
                          row["revoked_at"] is not None)
        keys[key_hash] = ref
        return ref


_cache = _Cache()


def _bearer(authorization: str) -> str:
    scheme, _, value = authorization.strip().partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def _invalid_key(message: str) -> TenantError:
    return TenantError(message, 401, "invalid_api_key")


def _shown(header: str) -> str:
    """A header value as error messages quote it: a header can be kilobytes long."""
    return header if len(header) <= 64 else header[:64] + "..."


async def _selected(slug: str) -> TenantRef:
    tenant = await _cache.tenant(slug=slug)
    if tenant is None:
        raise TenantError(f"Tenant not found: '{_shown(slug)}'", 404, "tenant_not_found", param="X-Tenant-ID")
    if not tenant.active:
        raise TenantError(f"Tenant '{slug}' is inactive.", 403, "tenant_inactive", param="X-Tenant-ID",
                          tenant_id=tenant.id)
    return tenant


async def identify(authorization: str, tenant_header: str | None) -> Caller:
    """The caller of a request, from its ``Authorization`` and ``X-Tenant-ID`` headers (rules above).

    Raises:
        TenantError: 401 (missing or invalid key), 403 (inactive tenant, header naming another
            tenant than the key's), 404 (unknown tenant).
        redis.exceptions.RedisError: Redis is unreachable.
    """
    await _cache.sync()
    cfg = settings.TESSERA
    deployment_key = cfg.get("API_KEY")
    key_only = bool(cfg.get("KEY_ONLY")) or bool(deployment_key)
    header = (tenant_header or "").strip() or None
    secret = _bearer(authorization)
    if not secret and KEY_PREFIX in authorization:  # a tenant key without its scheme (or in another one)
        raise _invalid_key("Pass the API key as 'Authorization: Bearer <key>' (the 'Bearer ' is missing).")
    if deployment_key and secret and hmac.compare_digest(secret.encode(), deployment_key.encode()):
        return Caller(await _selected(header or DEFAULT_TENANT_SLUG))
    if secret.startswith(KEY_PREFIX):
        digest = hash_secret(secret)
        key = await _cache.key(digest)
        if key is None or not hmac.compare_digest(key.key_hash, digest):
            raise _invalid_key(f"Invalid API key ({secret[:len(KEY_PREFIX) + 4]}…): no such key.")
        if key.revoked:
            raise _invalid_key(f"API key {key.prefix}… has been revoked.")
        if key.expires_at is not None and key.expires_at <= timezone.now():
            raise _invalid_key(f"API key {key.prefix}… expired at {key.expires_at:%Y-%m-%d %H:%M} UTC.")
        tenant = await _cache.tenant(id=key.tenant_id)
        if tenant is None:  # deleted after the key was cached: the next version drops the key too
            raise _invalid_key(f"API key {key.prefix}… has no tenant.")
        if header is not None and header != tenant.slug:
            raise TenantError(f"X-Tenant-ID '{_shown(header)}' names another tenant than the API key's "
                              f"('{tenant.slug}').",
                              403, "tenant_mismatch", param="X-Tenant-ID", tenant_id=tenant.id, key_id=key.id)
        if not tenant.active:
            raise TenantError(f"Tenant '{tenant.slug}' is inactive.", 403, "tenant_inactive", tenant_id=tenant.id,
                              key_id=key.id)
        return Caller(tenant, key.id)
    if key_only:
        if secret:
            raise _invalid_key("Invalid API key: pass a valid key as 'Authorization: Bearer <key>'.")
        raise _invalid_key("Missing API key: pass it as 'Authorization: Bearer <key>'.")
    tenant = await _selected(header or DEFAULT_TENANT_SLUG)
    if tenant.has_keys:
        raise _invalid_key(f"Tenant '{tenant.slug}' requires an API key: pass it as 'Authorization: Bearer <key>'.")
    return Caller(tenant)
