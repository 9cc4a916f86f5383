"""Tenant pages: a member sees their tenant's keys (issue one, shown once; revoke) and its usage
per day and model. Every page needs a login; a user sees only the tenants they are a member
of (others are 404, as if they did not exist); forms are CSRF-protected (Django's middleware)."""
from __future__ import annotations

import datetime as dt
from collections import defaultdict

from django.contrib.auth.decorators import login_required
from django.db.models import Sum
from django.db.models.functions import TruncDate
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from .forms import NewKeyForm
from .models import ApiKey, Tenant, Usage

USAGE_DAYS = 30


def _visible_tenants(request: HttpRequest):
    if request.user.is_superuser:
        return Tenant.objects.all()
    return Tenant.objects.filter(members=request.user)


def _tenant(request: HttpRequest, slug: str) -> Tenant:
    return get_object_or_404(_visible_tenants(request), slug=slug)


@login_required
def tenant_list(request: HttpRequest) -> HttpResponse:
    tenants = list(_visible_tenants(request))
    if len(tenants) == 1:
        return redirect("tenants:detail", slug=tenants[0].slug)
    return render(request, "tenants/list.html", {"tenants": tenants})


def usage_chart(tenant: Tenant, days: int = USAGE_DAYS) -> dict:
    """Tokens per UTC day and model over the last ``days`` days: rows for a bar chart."""
    since = (timezone.now() - dt.timedelta(days=days - 1)).replace(hour=0, minute=0, second=0, microsecond=0)
    rows = (Usage.objects.filter(tenant=tenant, hour__gte=since)
            .annotate(day=TruncDate("hour", tzinfo=dt.timezone.utc)).values("day", "model")
            .annotate(requests=Sum("requests"), prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"))
            .order_by("-day", "model"))
    by_day: dict[dt.date, list[dict]] = defaultdict(list)
    for row in rows:
        row["tokens"] = row["prompt"] + row["completion"]
        by_day[row["day"]].append(row)
    peak = max((row["tokens"] for day in by_day.values() for row in day), default=0) or 1
    for day in by_day.values():
        for row in day:
            row["percent"] = round(100 * row["tokens"] / peak, 1)
    return {"days": sorted(by_day.items(), reverse=True), "since": since.date()}


@login_required
def tenant_detail(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = _tenant(request, slug)
    return render(request, "tenants/detail.html", {
        "tenant": tenant, "keys": tenant.api_keys.all(), "form": NewKeyForm(), **usage_chart(tenant)})


@login_required
@require_POST
def key_create(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = _tenant(request, slug)
    form = NewKeyForm(request.POST)
    if not form.is_valid():
        return render(request, "tenants/detail.html", {
            "tenant": tenant, "keys": tenant.api_keys.all(), "form": form, **usage_chart(tenant)}, status=400)
    days = form.cleaned_data["expires_in_days"]
    expires = timezone.now() + dt.timedelta(days=days) if days else None
    key, secret = ApiKey.issue(tenant, form.cleaned_data["name"], expires)
    response = render(request, "tenants/key_created.html", {"tenant": tenant, "key": key, "secret": secret})
    response["Cache-Control"] = "no-store"
    return response


@login_required
@require_POST
def key_revoke(request: HttpRequest, slug: str, key_id: int) -> HttpResponse:
    tenant = _tenant(request, slug)
    key = ApiKey.objects.filter(tenant=tenant, id=key_id).first()
    if key is None:
        raise Http404("No such key.")
    key.revoke()
    return redirect("tenants:detail", slug=tenant.slug)
