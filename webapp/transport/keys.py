"""Every Redis key of Tessera, one builder or constant each, with its Redis type and contents.

``<model>`` is a served model's name, ``<tenant>`` a tenant's slug (empty for requests of no
tenant), ``<rid>`` an engine request id, ``<id>`` a worker's id. The Channels layer's own keys
(reply and control channels) are named by channels-redis (:mod:`.channel_layer`).
"""
from __future__ import annotations

# ---- request queues and the share-aware dequeue (webapp.serving.request_queue) -------------

EPOCH_KEY = "tessera:epoch"
"""String: a random value set by the first enqueue into an empty Redis. When it changes, Redis lost
its data (a restart without persistence) and with it the queued requests, which their web
processes then enqueue again."""


def queue_key(model: str, tenant: str | None) -> str:
    """List ``tessera:queue:<model>:<tenant>``: :class:`~.wire.QueuedRequest` messages of ``tenant``
    (None: of no tenant); the web process pushes on the left, workers take from the right (first in,
    first out) and a request given back goes to the right again (next in line)."""
    return f"tessera:queue:{model}:{tenant or ''}"


def queue_prefix(model: str) -> str:
    """The part of :func:`queue_key` before the tenant (the dequeue scripts append the slug)."""
    return queue_key(model, "")


def queues_key(model: str) -> str:
    """Set ``tessera:queues:<model>``: the tenants that have a queue of ``model``."""
    return f"tessera:queues:{model}"


DOORBELL_LENGTH = 64  # rings kept: enough to wake every idle worker of a model


def doorbell_key(model: str) -> str:
    """List ``tessera:doorbell:<model>``: a short list the web process pushes to after enqueueing,
    so that an idle worker's blocking pop wakes at once instead of polling (at most
    ``DOORBELL_LENGTH`` rings)."""
    return f"tessera:doorbell:{model}"


def fair_key(model: str) -> str:
    """Hash ``tessera:fair:<model>``: the model's virtual token counters shared by all its workers:
    ``vt`` (the virtual time), ``c:<tenant>`` (:func:`counter_field`) and ``served:<tenant>``
    (:func:`served_field`)."""
    return f"tessera:fair:{model}"


VIRTUAL_TIME_FIELD = "vt"
COUNTER_FIELD_PREFIX = "c:"
SERVED_FIELD_PREFIX = "served:"


def counter_field(tenant: str | None) -> str:
    """Field of :func:`fair_key`: the tenant's virtual token counter, in tokens per percent of share."""
    return f"{COUNTER_FIELD_PREFIX}{tenant or ''}"


def served_field(tenant: str | None) -> str:
    """Field of :func:`fair_key`: tokens the workers computed for the tenant (prompt tokens at a
    request's first output, then every output token; the dashboard's share chart)."""
    return f"{SERVED_FIELD_PREFIX}{tenant or ''}"


# ---- requests taken by workers, and their claims (webapp.serving.held, .worker_registry) ---

def held_key(model: str) -> str:
    """Hash ``tessera:held:<model>``: request id -> JSON ``{"worker", "payload", "charge"}`` of each
    request a worker took off the queue and has not started yet (``payload``: the encoded request,
    ``charge``: virtual tokens its tenant's counter was charged)."""
    return f"tessera:held:{model}"


def claim_key(request_id: str) -> str:
    """String ``tessera:claim:<rid>``: the id of the worker whose engine took the request,
    ``"aborted"`` when the client left before any worker took it, or ``"requeued"`` when the worker
    that took it died before starting it and another worker put it back on the queue. Set only
    when absent or ``"requeued"``, so exactly one party wins; kept a while after the request ended,
    for late redeliveries and copies."""
    return f"tessera:claim:{request_id}"


# ---- workers (webapp.serving.worker_registry, .commands, .worker_slot) ---------------------

WORKERS_KEY = "tessera:workers"
"""Sorted set: worker id -> time (s) of its last heartbeat."""


def worker_key(worker_id: str) -> str:
    """String ``tessera:worker:<id>``: JSON worker info (model, state, device, live stats), expiring
    a few seconds after the last heartbeat: a worker that died vanishes."""
    return f"tessera:worker:{worker_id}"


def commands_key(worker_id: str) -> str:
    """List ``tessera:worker:<id>:commands``: JSON model commands (load, unload, reload) to the
    worker, which pops them one at a time; expires a while after the last push."""
    return f"tessera:worker:{worker_id}:commands"


def slot_key(slot: str) -> str:
    """String ``tessera:worker-slot:<slot>``: JSON ``{"spec", "resumes"}``, the model the worker in
    one of ``serve``'s worker slots serves, and when a restarted worker resumed it."""
    return f"tessera:worker-slot:{slot}"


# ---- LoRA adapters (webapp.serving.lora_registry, webapp.catalog.lora) ----------------------

LORA_ADAPTERS_KEY = "tessera:lora:adapters"
"""Hash: adapter name -> JSON ``{"base_model", "path", "tenant"}`` of every LoRA adapter registered at run
time (the database's ``LoRAAdapter`` rows; ``tenant``: the owner's slug, null when public), rewritten whole
whenever one is added or removed. Workers read it with every heartbeat and load their model's adapters."""

LORA_VERSION_KEY = "tessera:lora:version"
"""String (a counter): increased with every change of the adapters; web processes drop their cached
adapters when it moves."""


def lora_reply_key(nonce: str) -> str:
    """List ``tessera:lora:reply:<nonce>``: one worker's JSON answer to one adapter check
    (:class:`webapp.serving.lora_registry.LoRACheck`); expires a minute after it is written."""
    return f"tessera:lora:reply:{nonce}"


# ---- metrics --------------------------------------------------------------------------------

def metrics_key(model: str) -> str:
    """Hash ``tessera:metrics:<model>``: the model's cumulative metrics over all its workers past and
    present (``webapp.serving.worker_metrics`` names the fields), plus ``created`` (the Unix time the
    totals started). Workers add increments; never expires."""
    return f"tessera:metrics:{model}"


METRICS_MODELS_KEY = "tessera:metrics:models"
"""Set: the models that have totals (:func:`metrics_key`), so that ``/metrics`` keeps exporting a
model's counters after its last worker unloaded it."""

TENANT_METRICS_KEY = "tessera:metrics:tenants"
"""Hash: JSON ``[counter, tenant, model, reason]`` -> value, the per-tenant Prometheus counters
(``tenants.counters``), added to by every web process."""

# ---- tenants (webapp.serving.tenant_shares, tenants.limits, tenants.identity) --------------

SHARES_KEY = "tessera:tenants:shares"
"""Hash: tenant slug -> JSON ``{"share": percent, "priority": int}`` of every active tenant,
rewritten whole (in one transaction) whenever a tenant is saved or deleted."""

VERSION_KEY = "tessera:tenants:version"
"""String (a counter): increased with every change of a tenant or an API key; web processes drop
their cached tenants and keys when it moves."""


def limits_keys(tenant_id: int, day: str) -> tuple[str, str, str, str, str, str]:
    """The keys of one tenant's gateway limits (``tessera:limits:<tenant id>:...``), in the order
    the limit scripts take them:

    * ``:inflight`` — sorted set, request id by lease expiry (concurrent requests);
    * ``:requests`` and ``:tokens`` — hashes ``level``, ``time``: the per-minute token buckets;
    * ``:day:<YYYYMMDD>`` — string, tokens counted on that UTC day (the daily budget);
    * ``:reserved:leases`` — sorted set, request id by lease expiry of its reservation;
    * ``:reserved`` — hash, request id -> completion tokens reserved against the day's budget.
    """
    base = f"tessera:limits:{tenant_id}"
    return (f"{base}:inflight", f"{base}:requests", f"{base}:tokens", f"{base}:day:{day}", f"{base}:reserved:leases",
            f"{base}:reserved")
