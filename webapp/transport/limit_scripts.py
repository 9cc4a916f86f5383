"""The Lua scripts of a tenant's gateway limits (:mod:`tenants.limits`): admitting a request against
all four limits at once, and settling it when it ends. Key names: :func:`.keys.limits_keys`. The
scripts read Redis's ``TIME``, so all web processes share one clock.
"""
from __future__ import annotations

# Token buckets (a hash ``level``, ``time``) refilled continuously at capacity/60 per second, and ``now``.
BUCKET_HELPERS = """
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
ADMIT = BUCKET_HELPERS + """
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
SETTLE = BUCKET_HELPERS + """
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
