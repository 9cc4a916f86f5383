"""``manage.py serve --tenant-id SLUG=SHARE%``: create or update tenants with their GPU shares."""
from __future__ import annotations

import re
from dataclasses import dataclass

from django.core.exceptions import ValidationError
from django.core.validators import validate_slug
from django.db import transaction

from .models import Tenant

_SPEC = re.compile(r"^(?P<slug>[^=]+?)\s*=\s*(?P<share>\d+(\.\d+)?)\s*%?$")


@dataclass(frozen=True)
class TenantSpec:
    """One ``--tenant-id`` value: the tenant's slug and its GPU share in percent."""

    slug: str
    gpu_share: int


def parse_tenant_spec(text: str) -> TenantSpec:
    """``team1=30%`` (or ``team1=30``), as the flag's help says.

    Raises:
        ValueError: not that shape (a bare ``team1`` too: the share is required, 0% for none), a slug
            with other characters than letters, digits, ``-`` and ``_``, or a share that is not a
            whole number from 0 to 100.
    """
    match = _SPEC.match(text.strip())
    if not match:
        raise ValueError(f"--tenant-id {text!r}: expected SLUG=SHARE%, e.g. team1=30% (the GPU share is "
                         "required; 0% for a tenant without a guaranteed share)")
    slug = match["slug"].strip()
    try:
        validate_slug(slug)
    except ValidationError:
        raise ValueError(f"--tenant-id {text!r}: the tenant id may contain only letters, digits, '-' and '_'") from None
    value = float(match["share"])
    if value != int(value) or not 0 <= value <= 100:
        raise ValueError(f"--tenant-id {text!r}: the GPU share must be a whole percentage from 0 to 100")
    return TenantSpec(slug, int(value))


def check_total(specs: list[TenantSpec]) -> None:
    """Raises ValueError when one tenant is given twice, or when the active tenants' shares, with ``specs``
    applied, exceed 100%. A spec naming an existing inactive tenant sets its share but does not count: the
    tenant stays off."""
    slugs = [spec.slug for spec in specs]
    for i, slug in enumerate(slugs):
        if slug in slugs[:i]:
            raise ValueError(f"--tenant-id: {slug!r} is given twice; give each tenant once")
    shares = dict(Tenant.objects.filter(active=True).values_list("slug", "gpu_share"))
    inactive = set(Tenant.objects.filter(active=False, slug__in=slugs)
                   .values_list("slug", flat=True))
    for spec in specs:
        if spec.slug not in inactive:
            shares[spec.slug] = spec.gpu_share
    total = sum(shares.values())
    if total > 100:
        listing = ", ".join(f"{slug} {share}%" for slug, share in sorted(shares.items()) if share)
        raise ValueError(f"--tenant-id: the active tenants' GPU shares would add up to {total}% ({listing}); "
                         "at most 100% can be guaranteed")


def apply_tenant_specs(specs: list[TenantSpec]) -> list[Tenant]:
    """Create the tenants (active) or update their shares (an inactive one stays inactive); returns them.

    Raises:
        ValueError: see :func:`check_total`.
    """
    with transaction.atomic():
        check_total(specs)
        tenants = []
        for spec in specs:
            # A new tenant starts active; an existing one keeps the admin's choice (a restart with the
            # same flags must not reactivate a tenant an operator switched off).
            tenant, _ = Tenant.objects.get_or_create(slug=spec.slug, defaults={"name": spec.slug, "active": True})
            tenant.gpu_share = spec.gpu_share
            tenant.save()
            tenants.append(tenant)
    return tenants
