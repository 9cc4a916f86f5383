"""A tenant's gateway limits, enforced atomically in Redis (correct with many web processes).

One Lua script admits a request against all four limits at once, and a second settles it
when it ends (:mod:`webapp.transport.limit_scripts`; the keys: :func:`webapp.transport.keys.limits_keys`):

* ``max_concurrent_requests``: a sorted set of the requests in flight (member: request id,
  score: lease expiry). A request ends by removing itself; a web process that died leaves
  leases that expire after ``LEASE_SECONDS``.
* ``requests_per_minute`` and ``tokens_per_minute``: token buckets (a hash ``level``,
  ``time``) of that capacity, refilled continuously at capacity/60 per second. Admission
  takes one request, and the prompt tokens from the token bucket; settling takes what the
  request actually used beyond that (completion tokens), or gives back the prompt tokens
  of prompts that never ran. The token bucket may go below zero: a long answer is never cut
  off, the next requests wait instead. A request is admitted while the bucket is above zero.
* ``daily_token_budget``: a counter per tenant and UTC day (prompt + completion tokens), started
  from the day's usage records when it does not exist yet (a budget set during the day, a new Redis).
  It is a hard cap: admission counts the prompt and reserves the most the request can generate (``n``
  times its ``max_tokens`` per prompt) in a per-tenant table of reservations (request id -> tokens,
  leased like a concurrency slot, so a web process that dies mid-request frees it after
  ``LEASE_SECONDS``). When less than that is left beside the day's count and the other requests'
  reservations, the request's ``max_tokens`` is capped to what is left (its answers then end with
  finish reason ``length``); one that could not get a token per choice is refused: until midnight
  when the day's count alone leaves no room, for a few seconds when requests in flight hold it.
  Settling drops the reservation and counts the tokens used.

Refusals carry the seconds after which a retry can succeed (``Retry-After``), except that of a
prompt larger than the token limit itself, which no retry can help. Clock: the
scripts read Redis's ``TIME``, so all web processes share one clock.
"""
from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

from asgiref.sync import sync_to_async

from webapp.serving.web_redis import get_redis
from webapp.transport import limit_scripts
from webapp.transport.keys import limits_keys

from .errors import TenantError
from .identity import Limits, TenantRef
from .usage import tokens_since

LEASE_SECONDS = 600  # a concurrency slot of a web process that died is freed after this
DAY_TTL = 2 * 86400

_scripts: dict[tuple[int, str], object] = {}


def _script(source: str):
    client = get_redis()
    key = (id(client), source)
    if key not in _scripts:
        _scripts[key] = client.register_script(source)
    return _scripts[key]


def _utc_day(now: dt.datetime) -> str:
    return now.strftime("%Y%m%d")


@dataclass(frozen=True)
class Admission:
    """What admitting one request charged (to be settled when it ends).

    Attributes:
        charged_tokens: prompt tokens taken from the token bucket and the day's budget.
        max_tokens_cap: the most tokens each choice may generate within the day's budget (None: no cap).
    """

    tenant_id: int
    request_id: str
    limits: Limits
    day: str
    charged_tokens: int
    max_tokens_cap: int | None = None


async def admit(tenant: TenantRef, request_id: str, prompt_tokens: int, completion_tokens: int = 0,
                choices: int = 1) -> Admission | None:
    """Admit a request of ``prompt_tokens`` against ``tenant``'s limits (None: the tenant has none).

    ``completion_tokens`` is the most its ``choices`` answers (``n`` per prompt) can generate in all; the day's
    budget reserves them, or caps each answer's ``max_tokens`` (``Admission.max_tokens_cap``) to what it has left.

    Raises:
        TenantError: 429 ``rate_limit_exceeded`` (type ``requests`` or ``tokens``) with ``retry_after``;
            without ``retry_after`` when the prompt alone is over ``tokens_per_minute`` or
            ``daily_token_budget`` (no retry can succeed).
        redis.exceptions.RedisError: Redis is unreachable.
    """
    limits = tenant.limits
    if not limits.any:
        return None
    _check_size(tenant.slug, limits, prompt_tokens, max(choices, 1))
    now = dt.datetime.now(dt.timezone.utc)
    day = _utc_day(now)
    if limits.daily_token_budget:
        await _start_day_counter(tenant.id, now, day)
    reply = await _script(limit_scripts.ADMIT)(keys=list(limits_keys(tenant.id, day)), args=[
        request_id, limits.max_concurrent_requests or 0, limits.requests_per_minute or 0,
        limits.tokens_per_minute or 0, limits.daily_token_budget or 0, prompt_tokens, LEASE_SECONDS, DAY_TTL,
        completion_tokens, max(choices, 1)])
    verdict = reply[0].decode() if isinstance(reply[0], bytes) else reply[0]
    if verdict == "ok":
        cap = int(reply[1])
        return Admission(tenant.id, request_id, limits, day, prompt_tokens, None if cap < 0 else cap)
    seconds = float(reply[1])
    if verdict == "budget":
        midnight = (now + dt.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
        seconds = (midnight - now).total_seconds()
    detail = ""
    if verdict in ("budget", "reserved"):
        counted, held = int(reply[2]), int(reply[3])
        detail = (f" Counted today: {counted} tokens; held by requests in flight: {held}; this request needs "
                  f"{prompt_tokens} prompt tokens and at least {max(choices, 1)} generated (one per answer).")
    raise _refusal(tenant.slug, limits, verdict, max(1, math.ceil(seconds)), detail)


async def _start_day_counter(tenant_id: int, now: dt.datetime, day: str) -> None:
    """A missing day counter (the first budgeted request of the day, a budget set during the day, a new
    Redis) starts from the tokens the usage records hold for today, so that the budget counts the
    whole UTC day, as the dashboard does; one ``EXISTS`` otherwise."""
    key = limits_keys(tenant_id, day)[3]
    redis = get_redis()
    if await redis.exists(key):
        return
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    used = await sync_to_async(tokens_since, thread_sensitive=True)(tenant_id, midnight)
    await redis.set(key, used, nx=True, ex=DAY_TTL)


def _check_size(slug: str, limits: Limits, prompt_tokens: int, choices: int) -> None:
    """Refuse a prompt larger than a token limit's whole capacity (for the day's budget, with a token for each
    of the ``choices`` answers): it could never be admitted."""
    answers = f"one generated token for each of {choices} answers" if choices > 1 else "one generated token"
    for what, limit, needed, of in (
            ("tokens per min (TPM)", limits.tokens_per_minute, prompt_tokens, "prompt tokens"),
            ("tokens per UTC day (daily budget)", limits.daily_token_budget, prompt_tokens + choices,
             f"{prompt_tokens} prompt tokens and {answers}")):
        if limit and needed > limit:
            raise TenantError(f"Request too large for tenant '{slug}' on {what}: Limit {limit}, Requested "
                              f"{needed} ({of}). Shorten the prompt (or lower n) to fit the limit; "
                              "retrying cannot help.", 429, "rate_limit_exceeded", type="tokens")


def _refusal(slug: str, limits: Limits, verdict: str, retry_after: int, detail: str = "") -> TenantError:
    what, limit, kind = {
        "concurrent": ("concurrent requests", limits.max_concurrent_requests, "requests"),
        "requests": ("requests per min (RPM)", limits.requests_per_minute, "requests"),
        "tokens": ("tokens per min (TPM)", limits.tokens_per_minute, "tokens"),
        "budget": ("tokens per UTC day (daily budget)", limits.daily_token_budget, "tokens"),
        "reserved": ("tokens per UTC day (daily budget), held by requests in flight", limits.daily_token_budget,
                     "tokens"),
    }[verdict]
    return TenantError(f"Rate limit reached for tenant '{slug}' on {what}: Limit {limit}.{detail} "
                       f"Please try again in {retry_after}s.", 429, "rate_limit_exceeded", type=kind,
                       retry_after=retry_after)


async def settle(admission: Admission, used_tokens: int) -> None:
    """End an admitted request: free its concurrency slot and count the tokens it actually used
    (prompt tokens of prompts that ran plus completion tokens) instead of what admission charged.

    Raises:
        redis.exceptions.RedisError: Redis is unreachable (the lease then expires by itself).
    """
    inflight, _, tokens, day, leases, reserved = limits_keys(admission.tenant_id, admission.day)
    limits = admission.limits
    await _script(limit_scripts.SETTLE)(keys=[inflight, tokens, day, leases, reserved], args=[
        admission.request_id, limits.tokens_per_minute or 0, 1 if limits.daily_token_budget else 0,
        used_tokens - admission.charged_tokens, DAY_TTL])
