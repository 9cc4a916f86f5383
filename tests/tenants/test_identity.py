"""Who a request is for: API keys, ``X-Tenant-ID``, key-only mode and the deployment key, against
the real stack. A refused request is never served as another tenant."""
from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys

import pytest

from tests.tenants.helpers import (  # noqa: F401 (fixtures)
    bearer, completion, make_tenant, orm, tenant_web, usage_totals, wait_for, wait_usage, web)
from tests.webapp.serving_stack import MODEL, http
from webapp import launcher


def _error(result, status: int) -> dict:
    got, _, body = result
    assert got == status, body
    return body["error"]


def test_header_selects_the_tenant_and_absent_means_default(tenant_web):
    from tenants.models import Tenant

    team = make_tenant()
    default = Tenant.objects.get(slug="default")
    before = usage_totals(default)["requests"]
    # The OpenAI SDK always sends some key; without keys configured it is ignored.
    status, _, body = completion(tenant_web.base_url, {"X-Tenant-ID": team.slug, **bearer("EMPTY")})
    assert status == 200, body
    usage = wait_usage(team, 1)
    assert usage["completion_tokens"] == body["usage"]["completion_tokens"]
    assert usage["prompt_tokens"] == body["usage"]["prompt_tokens"]
    status, _, _ = completion(tenant_web.base_url)
    assert status == 200
    wait_usage(default, before + 1)
    assert usage_totals(team)["requests"] == 1


def test_unknown_tenant_is_404_and_inactive_403(tenant_web):
    error = _error(completion(tenant_web.base_url, {"X-Tenant-ID": "nobody-here"}), 404)
    assert error["code"] == "tenant_not_found" and error["param"] == "X-Tenant-ID"
    # A UTF-8 header (sent as its bytes; http.client writes str headers as Latin-1) reads back as written.
    error = _error(completion(tenant_web.base_url, {"X-Tenant-ID": "équipe".encode().decode("latin-1")}), 404)
    assert "'équipe'" in error["message"]
    team = make_tenant(active=False)
    error = _error(completion(tenant_web.base_url, {"X-Tenant-ID": team.slug}), 403)
    assert error["code"] == "tenant_inactive" and team.slug in error["message"]
    usage = wait_usage(team, 1)  # the refusal is counted against the tenant, as a 403
    assert usage["errors_invalid_request"] == 1 and usage["prompt_tokens"] == usage["completion_tokens"] == 0


def test_key_identifies_its_tenant_and_the_header_must_agree(tenant_web):
    from tenants.models import ApiKey

    team, other = make_tenant(), make_tenant()
    key, secret = ApiKey.issue(team, "ci")
    status, _, body = completion(tenant_web.base_url, bearer(secret))
    assert status == 200, body
    status, _, _ = completion(tenant_web.base_url, {**bearer(secret), "X-Tenant-ID": team.slug})
    assert status == 200
    error = _error(completion(tenant_web.base_url, {**bearer(secret), "X-Tenant-ID": other.slug}), 403)
    assert error["code"] == "tenant_mismatch" and error["param"] == "X-Tenant-ID"
    usage = wait_usage(team, 3)  # two served, and the refusal, counted against the key's tenant
    assert usage["requests"] == 3 and usage["errors_invalid_request"] == 1
    assert usage_totals(other)["requests"] == 0
    key.refresh_from_db()
    assert wait_for(lambda: ApiKey.objects.get(id=key.id).last_used_at is not None)
    long_header = "x" * 10_000  # quoted shortened, not echoed whole
    error = _error(completion(tenant_web.base_url, {**bearer(secret), "X-Tenant-ID": long_header}), 403)
    assert error["code"] == "tenant_mismatch" and len(error["message"]) < 200, error["message"]


def test_a_tenant_key_without_bearer_is_401_not_the_default_tenant(tenant_web):
    from tenants.models import ApiKey, Tenant

    team = make_tenant()
    _, secret = ApiKey.issue(team)
    default_before = usage_totals(Tenant.objects.get(slug="default"))["requests"]
    error = _error(completion(tenant_web.base_url, {"Authorization": secret}), 401)
    assert error["code"] == "invalid_api_key" and "Bearer" in error["message"] and secret not in error["message"]
    assert completion(tenant_web.base_url, {"Authorization": "bearer " + secret})[0] == 200  # any case of it
    assert usage_totals(Tenant.objects.get(slug="default"))["requests"] == default_before


def test_a_tenant_with_keys_cannot_be_selected_by_header_alone(tenant_web):
    from tenants.models import ApiKey

    team = make_tenant()
    ApiKey.issue(team)
    error = _error(completion(tenant_web.base_url, {"X-Tenant-ID": team.slug}), 401)
    assert error["code"] == "invalid_api_key" and "requires an API key" in error["message"]
    assert completion(tenant_web.base_url, {"X-Tenant-ID": team.slug, **bearer("EMPTY")})[0] == 401
    assert usage_totals(team)["requests"] == 0


def test_revoked_expired_and_unknown_keys_are_401_at_once(tenant_web):
    from tenants.models import ApiKey

    team = make_tenant()
    key, secret = ApiKey.issue(team)
    assert completion(tenant_web.base_url, bearer(secret))[0] == 200
    key.revoke()  # takes effect on the next request in every web process (no cache delay)
    error = _error(completion(tenant_web.base_url, bearer(secret)), 401)
    assert error["code"] == "invalid_api_key" and "revoked" in error["message"]
    assert secret not in json.dumps(error) and key.prefix in error["message"]
    # Revoking the tenant's only key does not open it to callers without a key.
    assert _error(completion(tenant_web.base_url, {"X-Tenant-ID": team.slug}), 401)["code"] == "invalid_api_key"
    old, old_secret = ApiKey.issue(team, expires_at=dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1))
    assert "expired" in _error(completion(tenant_web.base_url, bearer(old_secret)), 401)["message"]
    unknown = ApiKey.new_secret()
    assert _error(completion(tenant_web.base_url, bearer(unknown)), 401)["code"] == "invalid_api_key"
    # Not even with a header naming a tenant without keys: a bad key is never another tenant.
    assert completion(tenant_web.base_url, {**bearer(unknown), "X-Tenant-ID": "default"})[0] == 401
    assert wait_usage(team, 1)["requests"] == 1


def test_model_not_allowed_is_403_and_not_listed(tenant_web):
    team = make_tenant(allowed_models=["some-other-model"])
    headers = {"X-Tenant-ID": team.slug}
    error = _error(completion(tenant_web.base_url, headers), 403)
    assert error["code"] == "model_not_allowed" and error["param"] == "model" and MODEL in error["message"]
    status, _, raw = http("GET", tenant_web.base_url + "/v1/models", headers=headers)
    assert status == 200 and json.loads(raw)["data"] == []
    tokenize = _post(tenant_web.base_url + "/tokenize", {"model": MODEL, "prompt": "hi"}, headers)
    assert _error(tokenize, 403)["code"] == "model_not_allowed"  # /tokenize does not reveal it either
    allowed = make_tenant(allowed_models=[MODEL])
    assert completion(tenant_web.base_url, {"X-Tenant-ID": allowed.slug})[0] == 200
    assert wait_usage(team, 1)["errors_invalid_request"] == 1


@pytest.fixture(scope="module")
def guarded(stack, orm, tmp_path_factory):
    """Daphnes in key-only mode, and with a deployment key (``serve --api-key``)."""
    stacks = {"key_only": web(stack, orm, tmp_path_factory, "key-only", TESSERA_KEY_ONLY="1"),
              "deployment_key": web(stack, orm, tmp_path_factory, "deployment-key", TESSERA_API_KEY="s3cret")}
    yield stacks
    for s in stacks.values():
        s.stop()


def test_key_only_mode(guarded):
    from tenants.models import ApiKey

    url = guarded["key_only"].base_url
    team = make_tenant()
    _, secret = ApiKey.issue(team)
    assert "Missing API key" in _error(completion(url), 401)["message"]
    assert _error(completion(url, {"X-Tenant-ID": "default"}), 401)["code"] == "invalid_api_key"
    assert _error(completion(url, bearer("EMPTY")), 401)["code"] == "invalid_api_key"
    assert _error(http_json("GET", url + "/v1/models"), 401)["code"] == "invalid_api_key"
    assert completion(url, bearer(secret))[0] == 200
    # vLLM's tokenizer endpoints too: key-only means every API request
    tokenize = {"model": MODEL, "prompt": "hi"}
    assert _error(_post(url + "/tokenize", tokenize), 401)["code"] == "invalid_api_key"
    assert _error(_post(url + "/detokenize", {"tokens": [1]}, bearer("tsk-bogus")), 401)["code"] == "invalid_api_key"
    assert _post(url + "/tokenize", tokenize, bearer(secret))[0] == 200


def _post(url: str, body: dict, headers: dict | None = None):
    status, response_headers, raw = http("POST", url, body, headers=headers)
    return status, response_headers, json.loads(raw)


def test_deployment_key_picks_any_tenant(guarded):
    from tenants.models import ApiKey

    url = guarded["deployment_key"].base_url
    team = make_tenant()
    _, secret = ApiKey.issue(team)
    assert _error(completion(url, {"X-Tenant-ID": team.slug}), 401)["code"] == "invalid_api_key"
    assert completion(url, {**bearer("s3cret"), "X-Tenant-ID": team.slug})[0] == 200
    assert completion(url, bearer(secret))[0] == 200  # a tenant's own key works too
    assert wait_usage(team, 2)["requests"] == 2


def http_json(method: str, url: str, headers: dict | None = None):
    status, response_headers, raw = http(method, url, headers=headers)
    return status, response_headers, json.loads(raw)


def test_create_api_key_command_prints_the_secret_once(tenant_web, orm, stack):
    env = launcher.child_env(TESSERA_DB_PATH=str(orm), REDIS_URL=stack.redis_url)
    result = subprocess.run([sys.executable, launcher.MANAGE, "create_api_key", "cli-team", "--create-tenant",
                             "--name", "from the command line", "--expires-in-days", "30"],
                            env=env, capture_output=True, text=True, check=True, cwd=launcher.BASE_DIR)
    secret = result.stdout.strip()
    assert secret.startswith("tsk-") and "not shown again" in result.stderr and secret not in result.stderr
    assert "its requests need one from now on" in result.stderr  # the first key: keyless requests end here
    status, _, body = completion(tenant_web.base_url, bearer(secret))
    assert status == 200, body
    second = subprocess.run([sys.executable, launcher.MANAGE, "create_api_key", "cli-team"],
                            env=env, capture_output=True, text=True, check=True, cwd=launcher.BASE_DIR)
    assert "not shown again" in second.stderr and "from now on" not in second.stderr
    failed = subprocess.run([sys.executable, launcher.MANAGE, "create_api_key", "no-such-team"],
                            env=env, capture_output=True, text=True, cwd=launcher.BASE_DIR)
    assert failed.returncode != 0 and "--create-tenant" in failed.stderr
    for slug, problem in (("bad slug!", "valid “slug”"), ("x" * 65, "at most 64 characters")):
        failed = subprocess.run([sys.executable, launcher.MANAGE, "create_api_key", slug, "--create-tenant"],
                                env=env, capture_output=True, text=True, cwd=launcher.BASE_DIR)
        assert failed.returncode != 0 and "Traceback" not in failed.stderr, failed.stderr
        assert f"Cannot create tenant '{slug}'" in failed.stderr and problem in failed.stderr, failed.stderr
    for days in ("0", "1e-300", "3651", "99999999", "inf", "nan"):  # not a traceback (an overflowing date, NaN)
        failed = subprocess.run([sys.executable, launcher.MANAGE, "create_api_key", "late-team", "--create-tenant",
                                 "--expires-in-days", days], env=env, capture_output=True, text=True,
                                cwd=launcher.BASE_DIR)
        assert failed.returncode != 0 and "Traceback" not in failed.stderr, failed.stderr
        assert "--expires-in-days must be a number of days from 0.000694 (one minute) to 3650" in failed.stderr
    failed = subprocess.run([sys.executable, launcher.MANAGE, "create_api_key", "late-team", "--create-tenant",
                             "--name", "n" * 101], env=env, capture_output=True, text=True, cwd=launcher.BASE_DIR)
    assert failed.returncode != 0 and "--name must be at most 100 characters" in failed.stderr, failed.stderr
    from tenants.models import Tenant

    assert not Tenant.objects.filter(slug="late-team").exists()  # refused before anything was created


def test_no_secret_in_the_database_or_logs(tenant_web, orm, stack):
    from tenants.models import ApiKey, hash_secret

    team = make_tenant()
    key, secret = ApiKey.issue(team, "plaintext check")
    assert completion(tenant_web.base_url, bearer(secret))[0] == 200
    key.revoke()
    assert completion(tenant_web.base_url, bearer(secret))[0] == 401
    database = b"".join(p.read_bytes() for p in orm.parent.glob(orm.name + "*"))  # with -wal/-journal files
    assert hash_secret(secret).encode() in database
    assert secret.encode() not in database and secret[len(key.prefix):].encode() not in database
    for log in [*tenant_web.logs_dir.glob("*.log"), *stack.logs_dir.glob("*.log")]:
        assert secret not in log.read_text(errors="replace"), log


def test_a_utf8_key_reads_back_as_written_in_the_401(tenant_web):
    error = _error(completion(tenant_web.base_url, bearer("tsk-été".encode().decode("latin-1"))), 401)
    assert error["code"] == "invalid_api_key" and "tsk-été" in error["message"]


def test_serve_tenant_flags_count_only_active_tenants_toward_100_percent(orm):
    """``serve --tenant-id`` on an existing inactive tenant sets its share, which does not count (the tenant
    stays off, as in the admin's check); a new or active tenant's share does."""
    from django.db import transaction

    from tenants.models import Tenant
    from tenants.provisioning import TenantSpec, check_total

    with transaction.atomic():
        others = sum(Tenant.objects.filter(active=True).values_list("gpu_share", flat=True))
        Tenant.objects.create(slug="flags-active", name="flags-active", gpu_share=max(0, 90 - others), active=True)
        Tenant.objects.create(slug="flags-off", name="flags-off", gpu_share=0, active=False)
        check_total([TenantSpec("flags-off", 20)])  # 90% active: the inactive tenant's 20% does not count
        with pytest.raises(ValueError, match="add up to"):
            check_total([TenantSpec("flags-new", 20)])
        transaction.set_rollback(True)
