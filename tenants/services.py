"""Tenant lookup for the API views, with a short in-process cache (no DB hit per request)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from .models import DEFAULT_TENANT_SLUG, Tenant

CACHE_SECONDS = 5.0


@dataclass(frozen=True)
class TenantRef:
    """What a request needs to know about its tenant: plain values, no model instance."""

    id: int
    slug: str


class TenantNotFound(LookupError):
    """No active tenant has this slug."""

    def __init__(self, slug: str) -> None:
        super().__init__(f"tenant not found: {slug!r}")
        self.slug = slug


_cache: dict[str, tuple[float, TenantRef | None]] = {}


async def resolve_tenant(slug: str | None) -> TenantRef:
    """The active tenant named by ``slug`` (the default tenant when ``slug`` is empty).

    Raises:
        TenantNotFound: no active tenant has that slug.
    """
    slug = (slug or "").strip() or DEFAULT_TENANT_SLUG
    now = time.monotonic()
    hit = _cache.get(slug)
    if hit is None or now - hit[0] > CACHE_SECONDS:
        tenant = await Tenant.objects.filter(slug=slug, active=True).values("id", "slug").afirst()
        hit = (now, TenantRef(**tenant) if tenant else None)
        _cache[slug] = hit
    if hit[1] is None:
        raise TenantNotFound(slug)
    return hit[1]
