"""Usage accounting: per tenant, model and hour, equal to the usage the responses reported,
with errors counted by kind; GPU shares edited like the admin does reach the running worker."""
from __future__ import annotations

import datetime as dt
import json

import pytest

from tests.tenants.helpers import (  # noqa: F401 (fixtures)
    completion, make_tenant, orm, tenant_web, usage_totals, wait_for, wait_usage)
from tests.webapp.serving_stack import MODEL, http, sse_events


def test_usage_equals_what_the_responses_reported(tenant_web):
    from tenants.models import Usage

    team = make_tenant()
    headers = {"X-Tenant-ID": team.slug}
    reported = []
    status, _, body = completion(tenant_web.base_url, headers, max_tokens=5)
    assert status == 200
    reported.append(body["usage"])
    status, _, body = completion(tenant_web.base_url, headers, max_tokens=3, prompt=["One", "Two three"], n=2)
    assert status == 200
    reported.append(body["usage"])
    status, _, raw = http("POST", tenant_web.base_url + "/v1/chat/completions",
                          {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                           "stream": True, "stream_options": {"include_usage": True}}, headers=headers)
    assert status == 200
    reported.append(json.loads(sse_events(raw)[-2])["usage"])
    usage = wait_usage(team, 3)
    assert usage["prompt_tokens"] == sum(u["prompt_tokens"] for u in reported)
    assert usage["completion_tokens"] == sum(u["completion_tokens"] for u in reported)
    assert sum(usage[k] for k in usage if k.startswith("errors_")) == 0
    (row,) = Usage.objects.filter(tenant=team)
    now = dt.datetime.now(dt.timezone.utc)
    assert row.model == MODEL and row.hour == now.replace(minute=0, second=0, microsecond=0)


def test_errors_are_counted_by_kind(tenant_web):
    team = make_tenant()
    headers = {"X-Tenant-ID": team.slug}
    assert completion(tenant_web.base_url, headers, temperature="hot")[0] == 400
    assert completion(tenant_web.base_url, headers, model="no-such-model")[0] == 404
    usage = wait_usage(team, 2)
    assert usage["errors_invalid_request"] == 2 and usage["prompt_tokens"] == usage["completion_tokens"] == 0


def test_share_edits_reach_the_running_worker(stack, orm):
    team = make_tenant(gpu_share=25)
    wait_for(lambda: any((w.get("tenant_shares") or {}).get(team.slug) == 25 for w in stack.worker_infos()))
    team.gpu_share = 40
    team.save()  # what the admin's save does
    wait_for(lambda: any((w.get("tenant_shares") or {}).get(team.slug) == 40 for w in stack.worker_infos()))
    team.active = False
    team.save()
    wait_for(lambda: all(team.slug not in (w.get("tenant_shares") or {}) for w in stack.worker_infos()))


def test_a_tenant_deleted_before_its_usage_is_written_loses_no_other_tenants_usage(orm):
    """Usage piled up for two tenants, one deleted before the write (as in the admin, mid-traffic): the
    other's usage is written (with SQLite, a foreign key fails only at the commit, which rolled back
    the whole batch)."""
    from tenants.models import Usage
    from tenants.usage import _Counts, _write

    keep, gone = make_tenant(), make_tenant()
    hour = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
    batch = {(gone.pk, MODEL, hour): _Counts(requests=1, prompt_tokens=2, completion_tokens=4),
             (keep.pk, MODEL, hour): _Counts(requests=1, prompt_tokens=3, completion_tokens=5)}
    gone.delete()
    _write(batch, {})
    row = Usage.objects.get(tenant=keep, model=MODEL, hour=hour)
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (1, 3, 5)
    assert not Usage.objects.filter(tenant_id=gone.pk).exists()


def test_a_prompt_prefilled_for_a_client_that_left_is_charged_to_its_tenant(tenant_web, stack):
    """The client leaves once its long prompt is prefilling, before any token came back: the prompt tokens the
    engine computed are in the tenant's usage record and its day's budget count, not free; and while the engine
    still computes it, the budget keeps it counted, so a request that would not fit beside it is refused."""
    import asyncio
    import random

    from tests.webapp.raw_http import open_stream
    from tests.webapp.test_serving_abort import _new_claim, _wait_idle
    from webapp.transport.keys import limits_keys

    team = make_tenant(daily_token_budget=3000)
    _wait_idle(stack, 30)
    rng = random.Random(3)
    prompt = [rng.randrange(1000, 30000) for _ in range(1900)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 50, "ignore_eos": True, "stream": True}

    async def run() -> None:
        known = set(stack.redis.keys("tessera:claim:*"))
        reader, writer, _ = await open_stream(tenant_web.base_url, "/v1/completions", body, read_head=False,
                                              headers={"X-Tenant-ID": team.slug})
        try:
            await asyncio.to_thread(_new_claim, stack, known)
            await asyncio.sleep(1.0)  # the engine took it at once; its prefill takes about 10 s on 2 cores
            with pytest.raises(TimeoutError):  # no token came back yet
                await asyncio.wait_for(reader.read(1), 0.01)
        finally:
            writer.transport.abort()

    asyncio.run(run())
    day = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d")
    wait_for(lambda: not stack.redis.hlen(limits_keys(team.id, day)[5]))  # the web process settled the abort
    assert int(stack.redis.get(limits_keys(team.id, day)[3]) or 0) >= len(prompt)  # the prompt stays counted
    other = [rng.randrange(1000, 30000) for _ in range(1900)]
    status, _, refused = completion(tenant_web.base_url, {"X-Tenant-ID": team.slug}, max_tokens=1, prompt=other)
    assert status == 429 and "daily budget" in refused["error"]["message"], refused  # 1,900 + 1,901 > 3,000
    usage = wait_for(lambda: (lambda u: u if u["errors_aborted"] == 1 else None)(usage_totals(team)), timeout=150)
    # The engine computes a 1,900-token prompt in one step here; the step running when the abort came counts
    assert usage["requests"] - usage["errors_rate_limited"] == 1, usage
    assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == 0, usage
    counted = int(stack.redis.get(limits_keys(team.id, day)[3]) or 0)
    assert len(prompt) <= counted <= len(prompt) + 50, counted  # the budget counts it; the reservation is gone
    assert not stack.redis.hlen(limits_keys(team.id, day)[5])
