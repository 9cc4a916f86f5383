"""``manage.py create_api_key TENANT [--name NAME] [--expires-in-days N]``: issue a key and print
its secret once (to stdout only; only its hash is stored)."""
from __future__ import annotations

import datetime as dt

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from tenants.models import ApiKey, Tenant


MAX_EXPIRY_DAYS = 3650
MIN_EXPIRY_DAYS = 1 / 1440  # a key that would expire before it is used is refused


class Command(BaseCommand):
    help = "Create an API key for a tenant and print its secret (shown only this once)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("tenant", help="The tenant's slug.")
        parser.add_argument("--name", default="", help="What the key is for.")
        parser.add_argument("--expires-in-days", type=float, help="Days until the key expires (default: never).")
        parser.add_argument("--create-tenant", action="store_true",
                            help="Create the tenant (no GPU share, no limits) when it does not exist.")

    def handle(self, *args, **options) -> None:
        slug = options["tenant"]
        days = options["expires_in_days"]
        if days is not None and not MIN_EXPIRY_DAYS <= days <= MAX_EXPIRY_DAYS:  # before anything is created (NaN too)
            raise CommandError(f"--expires-in-days must be a number of days from {MIN_EXPIRY_DAYS:.6f} (one minute) "
                               f"to {MAX_EXPIRY_DAYS} (10 years, the tenant page's longest; omit it for a key that "
                               f"never expires), got {days}.")
        max_name = ApiKey._meta.get_field("name").max_length
        if len(options["name"]) > max_name:
            raise CommandError(f"--name must be at most {max_name} characters, got {len(options['name'])}.")
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None:
            if not options["create_tenant"]:
                raise CommandError(f"No tenant '{slug}' (add --create-tenant to create it).")
            tenant = Tenant(slug=slug, name=slug[:Tenant._meta.get_field("name").max_length])
            try:
                tenant.full_clean()
            except ValidationError as error:
                problems = "; ".join(f"{field}: {' '.join(messages)}" for field, messages in error.message_dict.items())
                raise CommandError(f"Cannot create tenant '{slug}': {problems}") from None
            tenant.save()
        expires = timezone.now() + dt.timedelta(days=days) if days is not None else None
        first = not ApiKey.objects.filter(tenant=tenant).exists()
        key, secret = ApiKey.issue(tenant, options["name"], expires)
        self.stderr.write(f"API key {key.prefix}… for tenant '{tenant.slug}'"
                          + (f", expires {expires:%Y-%m-%d %H:%M} UTC" if expires else "")
                          + ". Store it now: it is not shown again.")
        if first:  # the tenant's requests without a key are refused from now on (docs/tenants.md)
            self.stderr.write(f"Tenant '{tenant.slug}' has a key now: its requests need one from now on "
                              "('Authorization: Bearer <key>'); requests without a key are answered 401"
                              + (", also those that name no tenant." if tenant.slug == "default" else "."))
        self.stdout.write(secret)
