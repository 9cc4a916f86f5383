"""Each tenant's share of the tokens served today (UTC), against its quota.

The tokens are the prompt and completion tokens of the requests that ended today, as the web
processes record them (:mod:`tenants.usage`, the same counts as the responses' ``usage``);
the quota is the tenant's GPU share (percent of the engine's tokens it is guaranteed while it
has work waiting) and its daily token budget.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.db.models import Sum
from django.utils import timezone

from tenants.models import Tenant, Usage


@dataclass(frozen=True)
class TenantUsage:
    """One tenant's row: ``tokens`` served today, ``share`` of all tenants' tokens today
    (0..1), ``gpu_share`` (percent), ``daily_token_budget`` (tokens or None) and
    ``budget_used`` (0..1, None without a budget)."""

    slug: str
    name: str
    active: bool
    tokens: int
    requests: int
    share: float
    gpu_share: int
    daily_token_budget: int | None
    budget_used: float | None


def tenant_usage_today(now: dt.datetime | None = None) -> list[TenantUsage]:
    """Every tenant's row (by slug), from the usage recorded since 00:00 UTC (database access:
    call from a thread, not the event loop)."""
    now = now or timezone.now()
    midnight = now.astimezone(dt.timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    used = {row["tenant"]: row for row in Usage.objects.filter(hour__gte=midnight).values("tenant").annotate(
        prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"), requests=Sum("requests"))}
    tokens = {tenant: row["prompt"] + row["completion"] for tenant, row in used.items()}
    everyone = sum(tokens.values())
    rows = []
    for tenant in Tenant.objects.order_by("slug"):
        mine = tokens.get(tenant.pk, 0)
        budget = tenant.daily_token_budget
        rows.append(TenantUsage(
            slug=tenant.slug, name=tenant.name, active=tenant.active, tokens=mine,
            requests=used.get(tenant.pk, {}).get("requests", 0), share=mine / everyone if everyone else 0.0,
            gpu_share=tenant.gpu_share, daily_token_budget=budget, budget_used=mine / budget if budget else None))
    return rows
