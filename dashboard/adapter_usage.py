"""Each LoRA adapter's requests today (UTC), for the overview page.

An adapter's requests are recorded in the tenants' usage under the adapter's name (:mod:`tenants.metering`),
so they are counted from the same records as the tenants' table. A viewer who is not staff sees the public
adapters and those of their tenants, counted over their tenants' requests only.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.db.models import Sum
from django.utils import timezone

from tenants.models import Usage
from webapp.catalog.models import LoRAAdapter

from .access import Viewer


@dataclass(frozen=True)
class AdapterUsage:
    """One adapter's row: its ``base_model``, owner (``tenant`` slug, None when public) and ``requests`` and
    ``tokens`` (prompt + completion) today."""

    name: str
    base_model: str
    tenant: str | None
    requests: int
    tokens: int


def adapter_usage_today(viewer: Viewer, now: dt.datetime | None = None) -> list[AdapterUsage]:
    """The registered adapters ``viewer`` may see, by name, with today's requests (database access: call from a
    thread, not the event loop)."""
    now = now or timezone.now()
    midnight = now.astimezone(dt.timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    adapters = LoRAAdapter.objects.select_related("tenant").order_by("name")
    usage = Usage.objects.filter(hour__gte=midnight)
    if not viewer.is_staff:
        adapters = [a for a in adapters if a.tenant is None or a.tenant.slug in viewer.tenant_slugs]
        usage = usage.filter(tenant__slug__in=viewer.tenant_slugs)
    names = [a.name for a in adapters]
    used = {row["model"]: row for row in usage.filter(model__in=names).values("model").annotate(
        requests=Sum("requests"), prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"))}
    return [AdapterUsage(a.name, a.base_model, a.tenant.slug if a.tenant else None,
                         used.get(a.name, {}).get("requests", 0),
                         used.get(a.name, {}).get("prompt", 0) + used.get(a.name, {}).get("completion", 0))
            for a in adapters]
