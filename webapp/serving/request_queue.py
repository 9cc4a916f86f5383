"""The model's request queues in Redis, one per tenant, and the share-aware dequeue over them.

Keys (``<model>`` is the served model's name, ``<tenant>`` a tenant's slug, empty for requests
of no tenant):

* ``tessera:queue:<model>:<tenant>`` — list of :class:`QueuedRequest` messages; the web
  process pushes on the left, workers take from the right (first in, first out) and a
  request given back goes to the right again (next in line).
* ``tessera:queues:<model>`` — set of the tenants that have a queue of ``<model>``.
* ``tessera:epoch`` — a random value set by the first enqueue into an empty Redis: when it
  changes, Redis lost its data (a restart without persistence) and with it the queued
  requests, which their web processes then enqueue again (:func:`enqueue` returns it).
* ``tessera:doorbell:<model>`` — a short list the web process pushes to after enqueueing,
  so that an idle worker's blocking pop wakes at once instead of polling.
* ``tessera:fair:<model>`` — hash, the model's virtual token counters shared by all its
  workers: ``vt`` (the virtual time), ``c:<tenant>`` (the tenant's counter, in tokens per
  percent of share) and ``served:<tenant>`` (tokens the workers computed for the tenant:
  prompt tokens at their first output, then every output token; the dashboard's share chart).

The dequeue (:data:`TAKE_SCRIPT`, one atomic Lua script) is start-time fair queuing over the
tenant queues, with the Virtual Token Counter of Sheng et al., "Fairness in Serving Large
Language Models" (OSDI 2024) as the tenants' finish tags — the counters the engine's
scheduler keeps (:mod:`inference.core.fair_share`), shared in Redis by every worker of the
model so that the shares hold in aggregate, not per worker:

* among the tenants with queued requests, the one with the lowest counter goes next (ties:
  the lower tenant priority, then the slug);
* a counter below the virtual time is lifted to it first: idle time earns no credit, and a
  tenant alone takes every request (work conservation);
* taking a request charges its tenant's counter with the tokens the request may cost, as the
  engine's scheduler charges a request it admits: its prompt plus ``n`` × ``max_tokens``,
  divided by the tenant's weight (its share in percent, at least
  :data:`inference.core.fair_share.MIN_SHARE`); the virtual time moves to the counter the
  tenant had (its start tag);
* when the request ends, the worker corrects the charge to the tokens it really cost
  (:class:`.ledger.RequestLedger`); a request given back to the queue is refunded.

Taking a request and recording it as held by the taking worker (:mod:`.held`) are one step,
so a request is always in a queue, held by a worker, or started: a worker that dies while
taking one loses nothing (the other workers requeue what it held).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from inference.core.fair_share import MIN_SHARE

from .held import held_key
from .registry import ABORTED, CLAIM_TTL, REQUEUED, claim_key
from .tenant_shares import SHARES_KEY

DOORBELL_LENGTH = 64  # rings kept: enough to wake every idle worker of a model


def queue_key(model: str, tenant: str | None) -> str:
    """The list of ``model``'s requests of ``tenant`` (None: of no tenant)."""
    return f"tessera:queue:{model}:{tenant or ''}"


def queues_key(model: str) -> str:
    return f"tessera:queues:{model}"


def doorbell_key(model: str) -> str:
    return f"tessera:doorbell:{model}"


def fair_key(model: str) -> str:
    return f"tessera:fair:{model}"


@dataclass(frozen=True)
class QueuedRequest:
    """One engine request on its way from a web process to a worker.

    Attributes:
        rid: the engine request id (unique across the cluster).
        reply: the Channels channel its messages go to.
        model: the served model's name.
        prompt_token_ids: the tokenized prompt.
        params: ``SamplingParams`` keyword arguments, validated by the web process.
        arrival: ``time.time()`` at the web process, in seconds.
        tenant: the tenant's slug (its GPU share), or None.
        priority: scheduling priority (lower runs earlier; the ``priority`` policy only).
        cache_salt: prefix-cache key, None to share with every unsalted request.
    """

    rid: str
    reply: str
    model: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    arrival: float
    tenant: str | None = None
    priority: int = 0
    cache_salt: str | None = None

    @property
    def cost(self) -> int:
        """Tokens the request may cost the engine, in tokens: its prompt plus ``n`` ×
        ``max_tokens`` (what the scheduler charges for admitting it)."""
        return max(1, len(self.prompt_token_ids)
                   + int(self.params.get("n") or 1) * int(self.params.get("max_tokens") or 0))

    def encode(self) -> str:
        """The queue's wire format: ``"<rid> <cost>\\n<JSON>"`` (the header lets the dequeue
        script charge the request without parsing the prompt)."""
        return f"{self.rid} {self.cost}\n{json.dumps(asdict(self), separators=(',', ':'))}"

    @classmethod
    def decode(cls, raw: bytes | str) -> QueuedRequest:
        """Inverse of :meth:`encode`.

        Raises:
            ValueError: ``raw`` is not such a message.
        """
        text = raw.decode() if isinstance(raw, bytes) else raw
        _, sep, body = text.partition("\n")
        try:
            return cls(**json.loads(body)) if sep else cls(**json.loads(text))
        except (TypeError, json.JSONDecodeError) as error:
            raise ValueError(f"not a queued request: {error}") from None


# Lua helpers shared by the scripts: a tenant's weight and priority from the shares hash, and the
# share-aware choice of the next tenant.
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
-- The tenant whose queue goes next (only: that tenant's, if it has requests), with its counter
-- lifted to the virtual time; nil when the queues are empty. KEYS[1]: the tenants set, KEYS[2]:
-- the fair hash, ARGV[1]: the queue key prefix.
local function pick(only)
  local vt = tonumber(redis.call('HGET', KEYS[2], 'vt') or '0')
  local best, best_c, best_p
  for _, tenant in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    if (only == nil or tenant == only) and redis.call('LLEN', ARGV[1] .. tenant) > 0 then
      local c = tonumber(redis.call('HGET', KEYS[2], 'c:' .. tenant) or '0')
      if c < vt then c = vt end
      local p = priority(tenant)
      if best == nil or c < best_c or (c == best_c and (p < best_p or (p == best_p and tenant < best))) then
        best, best_c, best_p = tenant, c, p
      end
    end
  end
  return best, best_c
end
"""

# KEYS: the tenants set, the fair hash, the shares hash, the held hash; ARGV: the queue key
# prefix, this worker's id, the only tenant to take from (used when ARGV[4] == '1'), the claim key
# prefix, ABORTED, REQUEUED, the claim's TTL (s). Returns false when every queue is empty, else
# {message, charge, status}: 'claimed' (held and claimed by this worker, its tenant charged),
# 'aborted' (its client left before any worker took it) or 'taken' (another worker has it); only a
# claimed request is charged and held.
TAKE_SCRIPT = _WEIGHT + """
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
REQUEUE_SCRIPT = _WEIGHT + """
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
NEXT_TENANT_SCRIPT = _WEIGHT + """
local best = pick(nil)
if best == nil then return false end
return {best}
"""

# KEYS[1] a queue; ARGV: request ids. Removes their messages (each starts with its id and a
# space), keeping the others in order.
DROP_SCRIPT = """
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


def _prefix(model: str) -> str:
    return queue_key(model, "")


EPOCH_KEY = "tessera:epoch"


async def epoch(redis) -> str:
    """The value of ``tessera:epoch``, set now if Redis has none (it lost its data)."""
    pipe = redis.pipeline(transaction=True)
    pipe.set(EPOCH_KEY, uuid.uuid4().hex, nx=True)
    pipe.get(EPOCH_KEY)
    return (await pipe.execute())[1].decode()


async def enqueue(redis, model: str, requests: list[QueuedRequest]) -> tuple[list[str], str, bool]:
    """Put ``requests`` on their tenants' queues of ``model`` (one pipeline) and ring the
    doorbell; returns the queues used, the epoch they were enqueued in (:func:`epoch`), and
    whether that epoch began now (Redis was empty: new, or it lost its data).

    ``redis``: an asyncio Redis client.

    Raises:
        RedisError: Redis could not be reached (nothing or everything was enqueued).
    """
    by_queue: dict[str, list[str]] = {}
    tenants = set()
    for request in requests:
        by_queue.setdefault(queue_key(model, request.tenant), []).append(request.encode())
        tenants.add(request.tenant or "")
    pipe = redis.pipeline(transaction=True)
    for queue, messages in by_queue.items():
        pipe.lpush(queue, *messages)
    pipe.sadd(queues_key(model), *tenants)
    pipe.lpush(doorbell_key(model), *["1"] * min(len(requests), DOORBELL_LENGTH))
    pipe.ltrim(doorbell_key(model), 0, DOORBELL_LENGTH - 1)
    pipe.set(EPOCH_KEY, uuid.uuid4().hex, nx=True)
    pipe.get(EPOCH_KEY)
    *_, began, current = await pipe.execute()
    return list(by_queue), current.decode(), bool(began)


CLAIMED, ABORTED_BEFORE, TAKEN = "claimed", "aborted", "taken"


@dataclass(frozen=True)
class Taken:
    """What :func:`take` took off a queue.

    Attributes:
        request: the request.
        status: ``CLAIMED`` (now held and claimed by the taking worker, its tenant charged),
            ``ABORTED_BEFORE`` (its client left before any worker took it) or ``TAKEN`` (another
            worker claimed it already); only a claimed request is the taker's to run.
        charge: virtual tokens added to its tenant's counter (0 unless claimed).
    """

    request: QueuedRequest
    status: str
    charge: float


def take(redis, model: str, worker_id: str, tenant: str | None = None, only_tenant: bool = False) -> Taken | None:
    """Take the next request of ``model`` by the tenants' shares (see the module docstring); a
    request still unclaimed is claimed for ``worker_id`` and recorded as held by it, in the same
    atomic step. ``only_tenant``: take from ``tenant``'s queue only. None: the queues are empty.

    Raises:
        RedisError: Redis could not be reached (nothing was taken).
    """
    taken = redis.register_script(TAKE_SCRIPT)(
        keys=[queues_key(model), fair_key(model), SHARES_KEY, held_key(model)],
        args=[_prefix(model), worker_id, tenant or "", "1" if only_tenant else "0", claim_key(""),
              ABORTED, REQUEUED, CLAIM_TTL])
    if not taken:
        return None
    status = taken[2].decode() if isinstance(taken[2], bytes) else taken[2]
    return Taken(QueuedRequest.decode(taken[0]), status, float(taken[1]))


def next_tenant(redis, model: str) -> tuple[bool, str | None]:
    """``(True, tenant)`` for the tenant whose request :func:`take` would take next (None: of no
    tenant); ``(False, None)`` when every queue of ``model`` is empty."""
    found = redis.register_script(NEXT_TENANT_SCRIPT)(keys=[queues_key(model), fair_key(model), SHARES_KEY],
                                                      args=[_prefix(model)])
    if not found:
        return False, None
    tenant = found[0].decode() if isinstance(found[0], bytes) else found[0]
    return True, tenant or None


def requeue(redis, model: str, message: str, tenant: str | None, charge: float) -> None:
    """Put an encoded request back at the head of its tenant's queue and refund ``charge``
    (virtual tokens) to the tenant's counter.

    Raises:
        RedisError: Redis could not be reached.
    """
    redis.register_script(REQUEUE_SCRIPT)(keys=[queues_key(model), fair_key(model), SHARES_KEY, doorbell_key(model)],
                                          args=[queue_key(model, tenant), tenant or "", message, charge])


def refund(redis, model: str, tenant: str | None, charge: float) -> None:
    """Take ``charge`` (virtual tokens) back from ``tenant``'s counter: a request it was charged
    for will not run (aborted, or a copy).

    Raises:
        RedisError: Redis could not be reached.
    """
    if charge:
        redis.hincrbyfloat(fair_key(model), f"c:{tenant or ''}", -charge)


def wait_doorbell(redis, model: str, timeout: float) -> None:
    """Block until a web process rings ``model``'s doorbell, or ``timeout`` seconds (at least 0.01)."""
    redis.blpop([doorbell_key(model)], timeout=max(0.01, timeout))


async def drop_queued(redis, queue: str, request_ids: list[str]) -> int:
    """Remove the messages of ``request_ids`` still waiting in ``queue`` (one atomic script, linear
    in the queue's length); returns how many it removed. For a client that left a large batch:
    its requests are marked aborted, but each message would otherwise still pass through a worker
    before the tenant's next request is reached.

    Raises:
        RedisError: Redis could not be reached.
    """
    return int(await redis.eval(DROP_SCRIPT, 1, queue, *request_ids))


def served_tokens(raw: dict[bytes, bytes]) -> dict[str | None, int]:
    """Tenant (None: no tenant) -> tokens served, from ``HGETALL`` of :func:`fair_key`."""
    served: dict[str | None, int] = {}
    for field, value in raw.items():
        name = field.decode() if isinstance(field, bytes) else field
        if name.startswith("served:"):
            served[name[len("served:"):] or None] = int(float(value))
    return served
