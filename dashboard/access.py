"""Who sees what on the dashboard.

Staff users see everything: every model with its workers (host, device, state, uptime) and
every tenant. Any other logged-in user sees the tenants they are a member of (the tenant's
*members* in the admin) and the models those tenants may use, as totals over the workers
(no worker list: hosts are the operators' business). A user who is a member of no tenant
sees no model and no tenant.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .stats import summarize

if TYPE_CHECKING:
    from .stats_poller import State


@dataclass(frozen=True)
class Viewer:
    """What one user may see: ``models`` None means every model."""

    username: str
    is_staff: bool
    tenant_slugs: frozenset[str]
    models: frozenset[str] | None

    def sees_model(self, name: str) -> bool:
        return self.models is None or name in self.models


def viewer_for(user) -> Viewer:
    """The :class:`Viewer` of an authenticated Django user (database access: call from a thread).

    Raises:
        PermissionError: ``user`` is not authenticated.
    """
    if not user.is_authenticated:
        raise PermissionError("the dashboard needs a logged-in user")
    if user.is_staff:
        return Viewer(user.get_username(), True, frozenset(), None)
    tenants = list(user.tenants.filter(active=True))
    models: set[str] | None = set()
    for tenant in tenants:
        if not tenant.allowed_models:
            models = None
            break
        models.update(tenant.allowed_models)
    if not tenants:
        models = set()
    return Viewer(user.get_username(), False, frozenset(t.slug for t in tenants),
                  None if models is None else frozenset(models))


def visible_snapshot(state: State, viewer: Viewer) -> dict[str, Any]:
    """The JSON the viewer gets: ``time`` (Unix s), ``totals`` (:func:`.stats.summarize` over
    the visible models), ``models`` (name, the same numbers, and ``workers`` for staff),
    ``idle_workers`` (workers serving no model; staff only, else empty) and ``tenants`` (rows
    of :class:`.tenant_usage.TenantUsage`, each with ``recent_share``: its share of the tokens
    served over the last seconds, 0..1, None when nothing was served)."""
    shown = [m for m in state.models if viewer.sees_model(m.name)]
    rows = []
    for model in shown:
        row = {"name": model.name, **summarize([model])}
        if viewer.is_staff:
            row["workers"] = [asdict(w) for w in model.workers]
        rows.append(row)
    return {
        "time": state.time,
        "viewer": {"username": viewer.username, "is_staff": viewer.is_staff},
        "totals": summarize(shown),
        "models": rows,
        "idle_workers": [asdict(w) for w in state.idle_workers] if viewer.is_staff else [],
        "tenants": [dict(asdict(t), recent_share=state.served_shares.get(t.slug, 0.0) if state.served_shares else None)
                    for t in state.tenants if viewer.is_staff or t.slug in viewer.tenant_slugs],
    }
