"""The Lua scripts of a request's way through Redis: the share-aware dequeue over the tenant queues
(:mod:`webapp.serving.request_queue`), the held records of taken requests (:mod:`webapp.serving.held`)
and the claims (:mod:`webapp.serving.worker_registry`). Each is atomic in Redis; the comment above each
gives its ``KEYS`` and ``ARGV`` (key names: :mod:`.keys`).
"""
from __future__ import annotations

from inference.sched.fair_share import MIN_SHARE

from .keys import DOORBELL_LENGTH

# ---- the request queues ---------------------------------------------------------------------

# Lua helpers shared by the queue scripts: a tenant's weight and priority from the shares hash, and
# the share-aware choice of the next tenant.
_WEIGHT = f"""
local function tenant_entry(tenant)
  if tenant == '' then return nil end
  local raw = redis.call('HGET', KEYS[3], tenant)
  if not raw then return nil end
  local ok, entry = pcall(cjson.decode, raw)
  if ok and type(entry) == 'table' then return entry end
  return nil
end
local function weight(tenant)
  local entry = tenant_entry(tenant)
  local share = entry and tonumber(entry['share']) or 0
  if share < {MIN_SHARE} then share = {MIN_SHARE} end
  return share
end
local function priority(tenant)
  local entry = tenant_entry(tenant)
  return entry and tonumber(entry['priority']) or 0
end
-- The tenant whose queue goes next (only: that tenant's, if it has requests) and its counter; nil
-- when the queues are empty. KEYS[1]: the tenants set, KEYS[2]: the fair hash, ARGV[1]: the queue
-- key prefix. No counter is lifted here (ENQUEUE lifts a tenant's when its queue was empty): a
-- counter below the virtual time while its tenant has requests queued was lowered by a refund or
-- a correction, credit the tenant is owed.
local function pick(only)
  local best, best_c, best_p
  for _, tenant in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    if (only == nil or tenant == only) and redis.call('LLEN', ARGV[1] .. tenant) > 0 then
      local c = tonumber(redis.call('HGET', KEYS[2], 'c:' .. tenant) or '0')
      local p = priority(tenant)
      if best == nil or c < best_c or (c == best_c and (p < best_p or (p == best_p and tenant < best))) then
        best, best_c, best_p = tenant, c, p
      end
    end
  end
  return best, best_c
end
"""

# KEYS: the tenants set, the fair hash, the doorbell, the epoch key; ARGV: the queue key prefix, a
# new epoch value (set if there is none), then for each tenant: the tenant ('' for none), the number
# of its messages, the messages. A tenant whose queue is empty has its counter lifted to the virtual
# time first (idle time earns no credit; a newcomer starts level with the others), then its
# messages are pushed. Returns {1 when the epoch began now else 0, the epoch}.
ENQUEUE = """
local vt = tonumber(redis.call('HGET', KEYS[2], 'vt') or '0')
local i, pushed = 3, 0
while i <= #ARGV do
  local tenant, n = ARGV[i], tonumber(ARGV[i + 1])
  local queue = ARGV[1] .. tenant
  if redis.call('LLEN', queue) == 0 then
    local c = tonumber(redis.call('HGET', KEYS[2], 'c:' .. tenant) or '0')
    if c < vt then redis.call('HSET', KEYS[2], 'c:' .. tenant, tostring(vt)) end
  end
  for j = i + 2, i + 1 + n, 1000 do redis.call('LPUSH', queue, unpack(ARGV, j, math.min(j + 999, i + 1 + n))) end
  redis.call('SADD', KEYS[1], tenant)
  pushed = pushed + n
  i = i + 2 + n
end
for _ = 1, math.min(pushed, %d) do redis.call('LPUSH', KEYS[3], '1') end
redis.call('LTRIM', KEYS[3], 0, %d)
local began = redis.call('SET', KEYS[4], ARGV[2], 'NX')
return {began and 1 or 0, redis.call('GET', KEYS[4])}
""" % (DOORBELL_LENGTH, DOORBELL_LENGTH - 1)

# KEYS: the tenants set, the fair hash, the shares hash, the held hash; ARGV: the queue key
# prefix, this worker's id, the only tenant to take from (used when ARGV[4] == '1'), the claim key
# prefix, ABORTED, REQUEUED, the claim's TTL (s). Returns false when every queue is empty, else
# {message, charge, status}: 'claimed' (held and claimed by this worker, its tenant charged),
# 'aborted' (its client left before any worker took it) or 'taken' (another worker has it); only a
# claimed request is charged and held.
TAKE = _WEIGHT + """
local only = nil
if ARGV[4] == '1' then only = ARGV[3] end
local best, best_c = pick(only)
if best == nil then return false end
local message = redis.call('RPOP', ARGV[1] .. best)
local rid, cost = string.match(message, '^(%S+) (%d+)\\n')
local claim_key = ARGV[5] .. rid
local owner = redis.call('GET', claim_key)
if owner == ARGV[6] then return {message, '0', 'aborted'} end
if owner and owner ~= ARGV[7] then return {message, '0', 'taken'} end
redis.call('SET', claim_key, ARGV[2], 'EX', ARGV[8])
local charge = tonumber(cost) / weight(best)
redis.call('HSET', KEYS[2], 'vt', tostring(best_c), 'c:' .. best, tostring(best_c + charge))
redis.call('HSET', KEYS[4], rid, cjson.encode({worker = ARGV[2], payload = message, charge = charge}))
return {message, tostring(charge), 'claimed'}
"""

# KEYS: the tenants set, the fair hash, the shares hash, the doorbell; ARGV: the queue key, the
# tenant, the message, the charge to refund. Puts a request back at the head of its queue.
REQUEUE = _WEIGHT + """
redis.call('RPUSH', ARGV[1], ARGV[3])
redis.call('SADD', KEYS[1], ARGV[2])
local charge = tonumber(ARGV[4])
if charge > 0 then redis.call('HINCRBYFLOAT', KEYS[2], 'c:' .. ARGV[2], -charge) end
redis.call('LPUSH', KEYS[4], '1')
redis.call('LTRIM', KEYS[4], 0, %d)
return 1
""" % (DOORBELL_LENGTH - 1)

# KEYS: the tenants set, the fair hash, the shares hash; ARGV: the queue key prefix. The tenant the
# next take would serve ('' for no tenant), or false when every queue is empty (read only).
NEXT_TENANT = _WEIGHT + """
local best = pick(nil)
if best == nil then return false end
return {best}
"""

# KEYS[1] a queue; ARGV: request ids. Removes their messages (each starts with its id and a
# space), keeping the others in order.
DROP = """
local drop = {}
for i = 1, #ARGV do drop[ARGV[i]] = true end
local items = redis.call('LRANGE', KEYS[1], 0, -1)
local keep, removed = {}, 0
for _, item in ipairs(items) do
  local rid = string.match(item, '^(%S+) ')
  if rid and drop[rid] then removed = removed + 1 else keep[#keep + 1] = item end
end
if removed > 0 then
  redis.call('DEL', KEYS[1])
  for i = 1, #keep, 1000 do redis.call('RPUSH', KEYS[1], unpack(keep, i, math.min(i + 999, #keep))) end
end
return removed
"""

# ---- held records -----------------------------------------------------------------------------

# KEYS: the held hash; ARGV: the request id, the worker's id.
RELEASE_HELD = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if raw and cjson.decode(raw)['worker'] == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""

# KEYS: the claim, the held hash; ARGV: this worker's id, the request id, ABORTED, the claim's TTL (s).
# 1: the claim is this worker's; -1: its client aborted it; 0: another worker took it over.
# A claim that is gone (Redis lost its data) is taken: the request's web process enqueued a copy,
# which then finds it claimed and is dropped.
SETTLE_HELD = """
local claim = redis.call('GET', KEYS[1])
if claim == false then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[4])
  claim = ARGV[1]
end
if claim == ARGV[1] then
  redis.call('HDEL', KEYS[2], ARGV[2])
  return 1
end
if claim == ARGV[3] then
  local raw = redis.call('HGET', KEYS[2], ARGV[2])
  if raw and cjson.decode(raw)['worker'] == ARGV[1] then
    redis.call('HDEL', KEYS[2], ARGV[2])
  end
  return -1
end
return 0
"""

# KEYS: the held hash, the claim; ARGV: the request id, the dead worker's id, REQUEUED, TTL (s), ABORTED.
TAKE_HELD = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw or cjson.decode(raw)['worker'] ~= ARGV[2] then
  return false
end
redis.call('HDEL', KEYS[1], ARGV[1])
local claim = redis.call('GET', KEYS[2])
if claim == ARGV[5] then
  return {raw, 'aborted'}
end
if claim == ARGV[2] then
  redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[4])
end
return {raw, 'requeue'}
"""

# KEYS: the claim, the held hash; ARGV: the request id, ABORTED, TTL (s).
ABORT_HELD = """
local owner = redis.call('GET', KEYS[1])
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if owner and raw and cjson.decode(raw)['worker'] == owner then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  return 1
end
return 0
"""

# ---- claims -----------------------------------------------------------------------------------

# KEYS[1] the claim; ARGV: new owner, TTL (s), REQUEUED. 1 when the caller now owns the claim.
CLAIM = """
local owner = redis.call('GET', KEYS[1])
if owner == false or owner == ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
  return 1
end
return 0
"""
