"""The model's request queues in Redis, one per tenant, and the share-aware dequeue over them.

The keys (:mod:`webapp.transport.keys`): a list of :class:`QueuedRequest` messages per model and
tenant (:func:`~webapp.transport.keys.queue_key`), the set of a model's tenants with a queue, a
doorbell that wakes idle workers, the model's virtual token counters
(:func:`~webapp.transport.keys.fair_key`) and the epoch that tells when Redis lost its data (then
the web processes enqueue their requests again: :func:`enqueue` returns it).

The dequeue (:data:`webapp.transport.queue_scripts.TAKE`, one atomic Lua script) is start-time
fair queuing over the tenant queues, with the Virtual Token Counter of Sheng et al., "Fairness in
Serving Large Language Models" (OSDI 2024) as the tenants' finish tags — the counters the
engine's scheduler keeps (:mod:`inference.sched.fair_share`), shared in Redis by every worker of
the model so that the shares hold in aggregate, not per worker:

* among the tenants with queued requests, the one with the lowest counter goes next (ties:
  the lower tenant priority, then the slug);
* a tenant whose queue was empty has its counter lifted to the virtual time when it enqueues
  (:data:`~webapp.transport.queue_scripts.ENQUEUE`): idle time earns no credit, and a tenant
  alone takes every request (work conservation); a counter lowered by a refund or a correction
  while the tenant has requests queued is not lifted, so the credit counts;
* taking a request charges its tenant's counter with the tokens the request may cost, as the
  engine's scheduler charges a request it admits: its prompt plus ``n`` × ``max_tokens``,
  divided by the tenant's weight (its share in percent, at least
  :data:`inference.sched.fair_share.MIN_SHARE`); the virtual time moves to the counter the
  tenant had (its start tag);
* when the request ends, the worker corrects the charge to the tokens it really cost
  (:class:`.ledger.RequestLedger`); a request given back to the queue is refunded.

Taking a request and recording it as held by the taking worker (:mod:`.held`) are one step,
so a request is always in a queue, held by a worker, or started: a worker that dies while
taking one loses nothing (the other workers requeue what it held).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from webapp.transport import queue_scripts
from webapp.transport.keys import (
    DOORBELL_LENGTH, EPOCH_KEY, SERVED_FIELD_PREFIX, SHARES_KEY, claim_key, counter_field, doorbell_key, fair_key,
    held_key, queue_key, queue_prefix, queues_key)
from webapp.transport.wire import InvalidParams, QueuedRequest

from .worker_registry import ABORTED, CLAIM_TTL, REQUEUED

__all__ = ["QueuedRequest", "Taken", "CLAIMED", "ABORTED_BEFORE", "TAKEN", "epoch", "enqueue", "take", "next_tenant",
           "requeue", "refund", "wait_doorbell", "drop_queued", "queued_counts", "served_tokens"]


async def epoch(redis) -> str:
    """The value of :data:`~webapp.transport.keys.EPOCH_KEY`, set now if Redis has none (it lost its data)."""
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
    by_tenant: dict[str, list[str]] = {}
    for request in requests:
        by_tenant.setdefault(request.tenant or "", []).append(request.encode())
    args: list[str | int] = [queue_prefix(model), uuid.uuid4().hex]
    for tenant, messages in by_tenant.items():
        args += [tenant, len(messages), *messages]
    began, current = await redis.eval(queue_scripts.ENQUEUE, 4, queues_key(model), fair_key(model),
                                      doorbell_key(model), EPOCH_KEY, *args)
    return [queue_key(model, tenant or None) for tenant in by_tenant], current.decode(), bool(began)


CLAIMED, ABORTED_BEFORE, TAKEN = "claimed", "aborted", "taken"


@dataclass(frozen=True)
class Taken:
    """What :func:`take` took off a queue.

    Attributes:
        request: the request (with default sampling parameters when ``invalid``).
        status: ``CLAIMED`` (now held and claimed by the taking worker, its tenant charged),
            ``ABORTED_BEFORE`` (its client left before any worker took it) or ``TAKEN`` (another
            worker claimed it already); only a claimed request is the taker's to run.
        charge: virtual tokens added to its tenant's counter (0 unless claimed).
        message: the request as it was queued (encoded).
        invalid: why its sampling parameters did not decode (a web process of another version
            sent them), None when they did.
    """

    request: QueuedRequest
    status: str
    charge: float
    message: str
    invalid: InvalidParams | None = None


def take(redis, model: str, worker_id: str, tenant: str | None = None, only_tenant: bool = False) -> Taken | None:
    """Take the next request of ``model`` by the tenants' shares (see the module docstring); a
    request still unclaimed is claimed for ``worker_id`` and recorded as held by it, in the same
    atomic step. ``only_tenant``: take from ``tenant``'s queue only. None: the queues are empty.

    Raises:
        RedisError: Redis could not be reached (nothing was taken).
    """
    taken = redis.register_script(queue_scripts.TAKE)(
        keys=[queues_key(model), fair_key(model), SHARES_KEY, held_key(model)],
        args=[queue_prefix(model), worker_id, tenant or "", "1" if only_tenant else "0", claim_key(""),
              ABORTED, REQUEUED, CLAIM_TTL])
    if not taken:
        return None
    message, charge, status = (part.decode() if isinstance(part, bytes) else part for part in taken)
    try:
        request, invalid = QueuedRequest.decode(message), None
    except InvalidParams as error:
        request, invalid = error.request, error
    return Taken(request, status, float(charge), message, invalid)


def next_tenant(redis, model: str) -> tuple[bool, str | None]:
    """``(True, tenant)`` for the tenant whose request :func:`take` would take next (None: of no
    tenant); ``(False, None)`` when every queue of ``model`` is empty."""
    found = redis.register_script(queue_scripts.NEXT_TENANT)(keys=[queues_key(model), fair_key(model), SHARES_KEY],
                                                      args=[queue_prefix(model)])
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
    redis.register_script(queue_scripts.REQUEUE)(keys=[queues_key(model), fair_key(model), SHARES_KEY, doorbell_key(model)],
                                          args=[queue_key(model, tenant), tenant or "", message, charge])


def refund(redis, model: str, tenant: str | None, charge: float) -> None:
    """Take ``charge`` (virtual tokens) back from ``tenant``'s counter: a request it was charged
    for will not run (aborted, or a copy).

    Raises:
        RedisError: Redis could not be reached.
    """
    if charge:
        redis.hincrbyfloat(fair_key(model), counter_field(tenant), -charge)


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
    return int(await redis.eval(queue_scripts.DROP, 1, queue, *request_ids))


async def queued_counts(redis, models: list[str]) -> dict[str, int]:
    """Model -> requests waiting in its queues in Redis (not yet taken by a worker; those of clients that left
    count until a worker drops them). Two round trips whatever the number of models and tenants.

    Raises:
        RedisError: Redis could not be reached.
    """
    pipe = redis.pipeline(transaction=False)
    for model in models:
        pipe.smembers(queues_key(model))
    tenants = await pipe.execute()
    pipe = redis.pipeline(transaction=False)
    owners = []
    for model, slugs in zip(models, tenants):
        for slug in slugs:
            pipe.llen(queue_key(model, slug.decode() if isinstance(slug, bytes) else slug))
            owners.append(model)
    counts = dict.fromkeys(models, 0)
    for model, length in zip(owners, await pipe.execute() if owners else []):
        counts[model] += int(length)
    return counts


def served_tokens(raw: dict[bytes, bytes]) -> dict[str | None, int]:
    """Tenant (None: no tenant) -> tokens served, from ``HGETALL`` of :func:`fair_key`."""
    served: dict[str | None, int] = {}
    for field, value in raw.items():
        name = field.decode() if isinstance(field, bytes) else field
        if name.startswith(SERVED_FIELD_PREFIX):
            served[name[len(SERVED_FIELD_PREFIX):] or None] = int(float(value))
    return served
