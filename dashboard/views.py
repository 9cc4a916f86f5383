"""Dashboard pages: the overview (models, workers, headline numbers, tenants' shares) and the
live metrics page (charts). Both need a login; what a user sees is :mod:`dashboard.access`'s
rule. The pages render the current numbers and keep them current over ``/ws/stats``."""
from __future__ import annotations

from asgiref.sync import async_to_sync
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from webapp.serving.recent_stats import RATE_WINDOW, WINDOW

from .access import viewer_for, visible_snapshot
from .adapter_usage import adapter_usage_today
from .served_shares import WINDOW as SHARE_WINDOW
from .stats_poller import stats_poller


async def _latest():
    return await stats_poller().latest()


def dashboard_context(request: HttpRequest) -> dict:
    """What a page with the dashboard's live numbers renders from: ``snapshot`` (the viewer's cut
    of the latest state) and the windows its numbers are measured over."""
    state = async_to_sync(_latest)()  # on the server's event loop, sharing its poller
    snapshot = visible_snapshot(state, viewer_for(request.user))
    return {"snapshot": snapshot, "window_s": int(WINDOW), "rate_window_s": int(RATE_WINDOW),
            "share_window_s": int(SHARE_WINDOW)}


@login_required
def overview(request: HttpRequest) -> HttpResponse:
    """The overview, with each LoRA adapter's requests today (as of the page load)."""
    context = dashboard_context(request)
    context["adapters"] = adapter_usage_today(viewer_for(request.user))
    return render(request, "dashboard/overview.html", context)


@login_required
def live(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/live.html", dashboard_context(request))
