"""The operators' pages share one layout: the tenant pages and their login show the dashboard's
navigation, so a user who logs in can reach every page without typing an address. Rendered by
Django's test client in this process, on the tests' own database."""
from __future__ import annotations

import os
import uuid

import pytest

NAV_LINKS = ('href="/dashboard/"', 'href="/dashboard/live/"', 'href="/tenants/"')


@pytest.fixture(scope="module")
def client():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()
    from django.core.management import call_command
    from django.test import Client

    call_command("migrate", interactive=False, verbosity=0)
    return Client()


def test_login_page_shows_the_dashboard_navigation(client):
    response = client.get("/tenants/login/")
    page = response.content.decode()
    assert response.status_code == 200 and '<nav class="site">' in page
    for link in NAV_LINKS:
        assert link in page, link
    assert "Log out" not in page


def test_tenant_list_shows_the_dashboard_navigation_and_the_member_s_tenants(client):
    from django.contrib.auth.models import User

    from tenants.models import Tenant

    suffix = uuid.uuid4().hex[:6]
    user = User.objects.create_user(f"carol-{suffix}", password="carol-pw")
    tenants = [Tenant.objects.create(slug=f"{c}-{suffix}", name=f"{c}-{suffix}") for c in ("green", "gray")]
    for tenant in tenants:  # with one tenant, the list redirects to its page
        tenant.members.add(user)
    assert client.login(username=user.username, password="carol-pw")
    response = client.get("/tenants/")
    page = response.content.decode()
    assert response.status_code == 200 and all(t.name in page for t in tenants)
    for link in NAV_LINKS:
        assert link in page, link
    assert "Log out" in page and 'href="/admin/"' not in page  # not staff
    client.logout()
