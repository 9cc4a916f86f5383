"""A tenant's gateway limits, enforced atomically in Redis (correct with many web processes).

One Lua script admits a request against all four limits at once, and a second settles it
when it ends:

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

from webapp.serving.client import get_redis

from .errors import TenantError
from .identity import Limits, TenantRef
from .usage import tokens_since

LEASE_SECONDS = 600  # a concurrency slot of a web process that died is freed after this
DAY_TTL = 2 * 86400

_BUCKET = """
local function bucket(key, capacity, now)
  local v = redis.call('HMGET', key, 'level', 'time')
  local level, at = tonumber(v[1]), tonumber(v[2])
  if level == nil then return capacity end
  return math.min(capacity, level + (now - at) * capacity / 60)
end
local function store(key, level, capacity, now)
  redis.call('HSET', key, 'level', tostring(level), 'time', tostring(now))
  redis.call('EXPIRE', key, math.ceil((capacity - level) * 60 / capacity) + 60)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# KEYS: in-flight set, requests bucket, tokens bucket, day counter, reservations' leases (sorted set: request id
#       by expiry), reservations (hash: request id -> completion tokens).
# ARGV: request id, max concurrent, requests/min, tokens/min, daily budget (0: no limit),
#       prompt tokens, lease seconds, day TTL, completion tokens asked for (all choices), choices.
# Returns {verdict, seconds to wait, day's count, reserved by others} or
#         {'ok', max tokens per choice (-1: uncapped), completion tokens reserved} (integers as Redis integers).
# A reservation's lease is LEASE_SECONDS from admission and is not renewed: a request that runs longer loses it
# (and its concurrency slot), as one of a web process that died.
_ADMIT = _BUCKET + """
local concurrent, rpm, tpm, budget = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local prompt = tonumber(ARGV[6])
if concurrent > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= concurrent then return {'concurrent', '1'} end
end
local requests_left, tokens_left = 0, 0
if rpm > 0 then
  requests_left = bucket(KEYS[2], rpm, now)
  if requests_left < 1 then return {'requests', tostring((1 - requests_left) * 60 / rpm)} end
end
if tpm > 0 then
  tokens_left = bucket(KEYS[3], tpm, now)
  if tokens_left <= 0 then return {'tokens', tostring((1 - tokens_left) * 60 / tpm)} end
end
local cap, reserved = -1, 0
if budget > 0 then
  local expired = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)
  for _, id in ipairs(expired) do
    redis.call('ZREM', KEYS[5], id)
    redis.call('HDEL', KEYS[6], id)
  end
  local held = 0
  for _, tokens in ipairs(redis.call('HVALS', KEYS[6])) do held = held + tonumber(tokens) end
  local wanted, choices = tonumber(ARGV[9]), tonumber(ARGV[10])
  local counted = tonumber(redis.call('GET', KEYS[4]) or '0')
  local left = budget - counted - held - prompt
  if left < choices then
    local verdict = 'budget'
    if budget - counted - prompt >= choices then verdict = 'reserved' end
    return {verdict, '2', counted, held}
  end
  if wanted <= left then reserved = wanted else cap = math.floor(left / choices); reserved = cap * choices end
end
if concurrent > 0 then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[7]), ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[7])
end
if rpm > 0 then store(KEYS[2], requests_left - 1, rpm, now) end
if tpm > 0 then store(KEYS[3], tokens_left - prompt, tpm, now) end
if budget > 0 then
  redis.call('INCRBY', KEYS[4], prompt)
  redis.call('EXPIRE', KEYS[4], ARGV[8])
  if reserved > 0 then
    redis.call('ZADD', KEYS[5], now + tonumber(ARGV[7]), ARGV[1])
    redis.call('HSET', KEYS[6], ARGV[1], reserved)
    redis.call('EXPIRE', KEYS[5], ARGV[7])
    redis.call('EXPIRE', KEYS[6], ARGV[7])
  end
end
return {'ok', cap, reserved}
"""

# KEYS: in-flight set, tokens bucket, day counter, reservations' leases, reservations.
# ARGV: request id, tokens/min at admission (0: none), counted the day (0/1), tokens used minus charged, day TTL.
# Run once per admission (Meter.finish is idempotent): a second run would apply the adjustment twice.
_SETTLE = _BUCKET + """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
local tpm, adjust = tonumber(ARGV[2]), tonumber(ARGV[4])
if adjust ~= 0 and tpm > 0 then store(KEYS[2], bucket(KEYS[2], tpm, now) - adjust, tpm, now) end
if adjust ~= 0 and ARGV[3] == '1' then
  if redis.call('INCRBY', KEYS[3], adjust) < 0 then redis.call('SET', KEYS[3], 0) end
  redis.call('EXPIRE', KEYS[3], ARGV[5])
end
return 1
"""

_scripts: dict[tuple[int, str], object] = {}


def _script(source: str):
    client = get_redis()
    key = (id(client), source)
    if key not in _scripts:
        _scripts[key] = client.register_script(source)
    return _scripts[key]


def _keys(tenant_id: int, day: str) -> tuple[str, str, str, str, str, str]:
    base = f"tessera:limits:{tenant_id}"
    return (f"{base}:inflight", f"{base}:requests", f"{base}:tokens", f"{base}:day:{day}", f"{base}:reserved:leases",
            f"{base}:reserved")


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
    reply = await _script(_ADMIT)(keys=list(_keys(tenant.id, day)), args=[
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
    key = _keys(tenant_id, day)[3]
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
    inflight, _, tokens, day, leases, reserved = _keys(admission.tenant_id, admission.day)
    limits = admission.limits
    await _script(_SETTLE)(keys=[inflight, tokens, day, leases, reserved], args=[
        admission.request_id, limits.tokens_per_minute or 0, 1 if limits.daily_token_budget else 0,
        used_tokens - admission.charged_tokens, DAY_TTL])
