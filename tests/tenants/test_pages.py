"""The admin and the tenant pages through Daphne, as a browser uses them: login required,
CSRF-protected forms, a key's secret shown once, revocation, and one tenant never seeing
another's keys or usage."""
from __future__ import annotations

import re
import uuid

import pytest

from tests.tenants.helpers import (  # noqa: F401 (fixtures)
    bearer, completion, make_tenant, orm, tenant_web, wait_usage)
from tests.webapp.browser import Browser


@pytest.fixture(scope="module")
def people(orm):
    """Two tenants with one member each, and an admin."""
    from django.contrib.auth.models import User

    suffix = uuid.uuid4().hex[:6]
    alice = User.objects.create_user(f"alice-{suffix}", password="alice-pw")
    bob = User.objects.create_user(f"bob-{suffix}", password="bob-pw")
    User.objects.create_superuser(f"root-{suffix}", password="root-pw")
    red, blue = make_tenant(slug=f"red-{suffix}"), make_tenant(slug=f"blue-{suffix}")
    red.members.add(alice)
    blue.members.add(bob)
    return {"alice": alice.username, "bob": bob.username, "root": f"root-{suffix}", "red": red, "blue": blue}


def test_pages_require_login(tenant_web, people):
    browser = Browser(tenant_web.base_url)
    for path in (f"/tenants/{people['red'].slug}/", "/tenants/", "/admin/tenants/apikey/", "/admin/tenants/usage/"):
        status, headers, _ = browser.get(path)
        assert status == 302 and "login" in headers["Location"], (path, status)
    status, _, _ = browser.post(f"/tenants/{people['red'].slug}/keys/", {"name": "x"}, csrf=False)
    assert status in (302, 403)


def test_member_issues_a_key_shown_once_and_revokes_it(tenant_web, people):
    from tenants.models import ApiKey

    red = people["red"]
    browser = Browser(tenant_web.base_url)
    browser.login("/tenants/login/", people["alice"], "alice-pw")
    status, _, page = browser.get(f"/tenants/{red.slug}/")
    assert status == 200 and red.name in page
    status, _, text = browser.post(f"/tenants/{red.slug}/keys/", {"name": "laptop"}, csrf=False)
    assert status == 403  # CSRF protection
    status, headers, page = browser.post(f"/tenants/{red.slug}/keys/", {"name": "laptop", "expires_in_days": "7"})
    assert status == 200 and headers.get("Cache-Control") == "no-store"
    secret = re.search(r'<pre id="api-key-secret">([^<]+)</pre>', page)[1]
    key = ApiKey.objects.get(tenant=red, name="laptop")
    assert key.prefix == secret[:len(key.prefix)] and key.expires_at is not None
    status, _, body = completion(tenant_web.base_url, bearer(secret))
    assert status == 200, body
    status, _, page = browser.get(f"/tenants/{red.slug}/")
    assert key.prefix in page and secret not in page  # listed, never shown again
    status, headers, _ = browser.post(f"/tenants/{red.slug}/keys/{key.id}/revoke/", {})
    assert status == 302
    assert completion(tenant_web.base_url, bearer(secret))[0] == 401


def test_usage_chart_per_day_and_model(tenant_web, people):
    from tests.webapp.serving_stack import MODEL

    red = people["red"]
    from tenants.models import ApiKey

    _, secret = ApiKey.issue(red)
    status, _, body = completion(tenant_web.base_url, bearer(secret), max_tokens=3)
    assert status == 200, body
    usage = wait_usage(red, 1)
    browser = Browser(tenant_web.base_url)
    browser.login("/tenants/login/", people["alice"], "alice-pw")
    _, _, page = browser.get(f"/tenants/{red.slug}/")
    chart = page[page.index('class="usage-chart"'):]
    assert MODEL in chart and f"<td>{usage['completion_tokens']}</td>" in chart and 'class="bar"' in chart


def test_a_tenant_never_sees_another_tenants_keys_or_usage(tenant_web, people):
    from tenants.models import ApiKey

    blue, red = people["blue"], people["red"]
    blue_key, _ = ApiKey.issue(blue, "blue's")
    browser = Browser(tenant_web.base_url)
    browser.login("/tenants/login/", people["alice"], "alice-pw")
    assert browser.get(f"/tenants/{blue.slug}/")[0] == 404
    _, _, page = browser.get(f"/tenants/{red.slug}/")
    assert blue_key.prefix not in page
    browser.get(f"/tenants/{red.slug}/")  # a valid CSRF token, used against the other tenant
    assert browser.post(f"/tenants/{blue.slug}/keys/{blue_key.id}/revoke/", {})[0] == 404
    assert browser.post(f"/tenants/{red.slug}/keys/{blue_key.id}/revoke/", {})[0] == 404
    assert browser.post(f"/tenants/{blue.slug}/keys/", {"name": "intruder"})[0] == 404
    blue_key.refresh_from_db()
    assert blue_key.revoked_at is None and not ApiKey.objects.filter(name="intruder").exists()
    status, headers, _ = browser.get("/admin/tenants/apikey/")  # not staff: the admin stays closed
    assert status == 302


def test_admin_issues_a_key_shown_once(tenant_web, people):
    from tenants.models import ApiKey

    blue = people["blue"]
    browser = Browser(tenant_web.base_url)
    browser.login("/admin/login/", people["root"], "root-pw")
    assert browser.get("/admin/tenants/apikey/add/")[0] == 200
    status, _, page = browser.post("/admin/tenants/apikey/add/", {"tenant": str(blue.id), "name": "from admin",
                                                                  "expires_at_0": "", "expires_at_1": ""})
    assert status == 200, page[:2000]
    secret = re.search(r'<pre id="api-key-secret"[^>]*>([^<]+)</pre>', page)[1]
    key = ApiKey.objects.get(tenant=blue, name="from admin")
    assert completion(tenant_web.base_url, bearer(secret))[0] == 200
    status, _, page = browser.get(f"/admin/tenants/apikey/{key.id}/change/")
    assert status == 200 and key.prefix in page and secret not in page
    browser.get("/admin/tenants/apikey/")
    status, _, _ = browser.post("/admin/tenants/apikey/", {"action": "revoke", "_selected_action": str(key.id)})
    assert status == 302
    assert completion(tenant_web.base_url, bearer(secret))[0] == 401


def test_admin_refuses_a_key_that_expired_already_and_an_empty_model_box_means_all(tenant_web, people):
    from tenants.models import ApiKey

    browser = Browser(tenant_web.base_url)
    browser.login("/admin/login/", people["root"], "root-pw")
    browser.get("/admin/tenants/apikey/add/")
    status, _, page = browser.post("/admin/tenants/apikey/add/", {
        "tenant": str(people["blue"].id), "name": "expired", "expires_at_0": "2020-01-01", "expires_at_1": "00:00:00"})
    assert status == 200 and "must expire in the future" in page, page[:2000]
    assert not ApiKey.objects.filter(name="expired").exists()
    team = make_tenant(allowed_models=["some-model"])
    team.allowed_models = None  # what the admin's form gives for an empty "Allowed models" box
    team.full_clean()
    assert team.allowed_models == [] and team.allows_model("any-model")


def test_the_admins_limit_fields_name_their_own_minimum(orm):
    """Any limit below 1 gets the same message (the column alone would say 0 for a negative value)."""
    from django.contrib import admin
    from django.contrib.auth.models import User
    from django.test import RequestFactory

    from tenants.models import Tenant

    request = RequestFactory().get("/admin/tenants/tenant/add/")
    request.user = User(is_superuser=True, is_staff=True)
    form_class = admin.site._registry[Tenant].get_form(request)
    for value in ("0", "-3"):
        form = form_class(data={"slug": f"t-{uuid.uuid4().hex[:6]}", "name": "t", "gpu_share": "0", "priority": "0",
                                "requests_per_minute": value})
        assert not form.is_valid()
        assert form.errors["requests_per_minute"] == ["Ensure this value is greater than or equal to 1."], form.errors
