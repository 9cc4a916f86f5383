"""Web side of the request path: enqueue engine requests, receive their deltas, watch the
worker, abort.

A request's messages come back on one Channels channel of this process. While it is
silent, the stream checks every ``SILENCE_CHECK`` seconds that the worker that claimed
each request still has a fresh heartbeat (and, before any claim, that some worker of the
model is live); if not, it raises :class:`WorkerLost` — so a client whose worker died gets
an error within ``SILENCE_CHECK + HEARTBEAT_TTL`` seconds (about 5 s) instead of hanging.
A request the dead worker had not started yet (still held, :mod:`.held`) is no loss: the
other workers requeue it, and the stream waits for it; when no worker of the model is live,
requests that have not started wait up to ``NO_WORKER_GRACE`` seconds for one (``serve``
restarts a worker that died) before the 503.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, AsyncIterator, NamedTuple

import redis.asyncio as aioredis
from channels.layers import get_channel_layer

from redis.exceptions import RedisError

from inference.sampling_params import SamplingParams
from webapp.transport.keys import claim_key, held_key

from . import held, worker_registry
from .messages import Abort, Message, is_final
from .replies import reply_router
from .web_redis import get_redis, heartbeating_workers, model_workers, retrieve_exception
from .request_queue import QueuedRequest, drop_queued, enqueue, epoch

logger = logging.getLogger(__name__)

DROP_QUEUED_MIN = 8  # unclaimed requests of an abort from which their messages are taken off the queue

GAP_GRACE = 3.0  # seconds later messages of a request may arrive before a missing one counts as lost
REDIS_OUTAGE_GRACE = 30.0  # seconds a request waits through Redis being unreachable (a restart)
ABORT_RETRY_FOR = 600.0  # seconds an abort is retried while Redis is unreachable
ABORT_RETRY_MAX_DELAY = 2.0  # seconds between two tries, at most

# Seconds an aborted stream waits for its workers' counts of what the engine computed (:class:`LeftBehind`); they
# come once each engine dropped its request, at its next step boundary (a long prefill chunk on a CPU takes seconds).
ABORT_REPORT_WAIT = 120.0

SILENCE_CHECK = 1.0  # seconds of silence after which the stream checks its worker
# Seconds a request that has not started waits for some worker of its model to be live again
# (``serve`` restarts a dead worker; an admin reload takes a while) before it is answered 503.
NO_WORKER_GRACE = 120.0

class WorkerLost(Exception):
    """The worker serving a request died or left, or no worker of the model is live."""


class ServerStopping(Exception):
    """The web server is shutting down and stops serving this request."""


request_stopped: ContextVar[asyncio.Future | None] = ContextVar("tessera_request_stopped", default=None)
"""Per HTTP request, set by the ASGI handler (:class:`webapp.handlers.APIHandler`): a future
that is done once the server stops serving the request (at shutdown)."""


@dataclass(frozen=True)
class EngineRequestSpec:
    """One engine request of an HTTP request (a completions call with several prompts has several)."""

    rid: str
    prompt_token_ids: list[int]
    params: SamplingParams  # validated, with the prompt's ``max_tokens``
    tenant: str | None = None  # the tenant's slug: its GPU share in the engine's scheduler
    priority: int = 0
    cache_salt: str | None = None  # prefix-cache key, e.g. per tenant
    lora_name: str | None = None  # the LoRA adapter it runs with, None: the base model
    lora_path: str | None = None  # that adapter's folder, as registered


class LeftBehind(NamedTuple):
    """What the engines computed for a stream's requests that its reader never saw: the prompt tokens of
    requests that had not answered when their client left (as far as their prefill had gone), and the output
    tokens published but not read."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


class GenerationStream:
    """Enqueue engine requests for ``model`` and yield their messages as they arrive.

    Messages of one engine request arrive in ``seq`` order; an error message ends its
    request. Use :meth:`abort` when the client goes away before the end.
    """

    def __init__(self, model: str, requests: list[EngineRequestSpec]) -> None:
        self.model = model
        self.requests = requests
        self.layer = get_channel_layer()
        self.reply: str | None = None
        self._unfinished = {r.rid for r in requests}
        self._next_seq = {r.rid: 0 for r in requests}
        self._held: dict[tuple[str, int], Message] = {}
        self._pending: collections.deque[Message] = collections.deque()  # arrived, not yet handled
        self._arrived: asyncio.Future | None = None  # set when messages arrive
        self._owners: dict[str, str] = {}  # request id -> worker that claimed it
        self._unclaimed_strikes = 0
        self._no_worker_since: float | None = None  # monotonic time since when no worker was live
        self._stopped = request_stopped.get()
        self._queues: list[str] = []  # the queues its requests were put on
        self._queued: dict[str, QueuedRequest] = {}  # what was enqueued, by request id
        self._epoch: str | None = None  # Redis's epoch when they were (request_queue.epoch)
        self._started: set[str] = set()  # requests a message of which arrived
        self._redis_down_since: float | None = None  # monotonic time since when Redis is unreachable
        self._gap_since: dict[str, float] = {}  # request id -> since when a message of it is missing
        self.left_behind: asyncio.Future[LeftBehind] | None = None  # see :meth:`start`

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def start(self) -> None:
        """Put every engine request on its tenant's queue of the model (:mod:`.request_queue`).

        The stream belongs to the task that starts it (the one serving the HTTP request):
        when that task ends with engine requests unfinished, however it ends (the client
        left and Django cancelled it, even in the middle of this call, before any chunk;
        the server stopped; an error), they are aborted, and :attr:`left_behind` then resolves, within
        ``ABORT_REPORT_WAIT`` seconds of the abort, to what the engines computed that the task never read
        (for the tenant's account; zeros when nothing was left unfinished or the task had no loop).
        """
        task = asyncio.current_task()
        _raise_if_cancelled(task)
        if task is not None:
            self.left_behind = asyncio.get_running_loop().create_future()
            task.add_done_callback(self._on_task_done)
        self._router = reply_router()
        self.reply = self._router.open(self._deliver)
        now = time.time()
        requests = [QueuedRequest(r.rid, self.reply, self.model, r.prompt_token_ids, r.params, now, r.tenant,
                                  r.priority, r.cache_salt, r.lora_name, r.lora_path) for r in self.requests]
        self._queued = {r.rid: r for r in requests}
        self._queues, self._epoch, began = await enqueue(get_redis(), self.model, requests)
        if began:  # Redis is new or lost its data: the workers need the tenants' shares again
            republish_shares()

    def _deliver(self, messages: list[Message]) -> None:
        self._pending.extend(messages)
        if self._arrived is not None and not self._arrived.done():
            self._arrived.set_result(None)

    def _on_task_done(self, _task: asyncio.Task) -> None:
        if not self._unfinished:
            self._close(LeftBehind())
            return
        abort = asyncio.ensure_future(self._abort_and_count())
        _background.add(abort)  # keep a reference until it is done
        abort.add_done_callback(_background.discard)
        abort.add_done_callback(retrieve_exception)  # a failure was logged

    def _close(self, left_behind: LeftBehind) -> None:
        if self.reply is not None:
            self._router.close(self.reply)
        if self.left_behind is not None and not self.left_behind.done():
            self.left_behind.set_result(left_behind)

    async def _abort_and_count(self) -> None:
        """Abort the unfinished requests, then count what their engines computed that nobody read: the late
        messages, and the workers' reports of each aborted request's computed prompt
        (:func:`.messages.aborted_message`), awaited for ``ABORT_REPORT_WAIT`` seconds at most."""
        rids = set(self._unfinished)
        self._pending.extend(self._held.values())  # arrived out of order, never read
        self._held.clear()
        prompt: dict[str, int] = {}
        completion, answered = 0, set()
        try:
            sent = await self.abort(retry_for=ABORT_RETRY_FOR)
            deadline = time.monotonic() + ABORT_REPORT_WAIT
            while True:
                while self._pending:
                    message = self._pending.popleft()
                    rid = message.get("rid")
                    if rid not in rids:
                        continue
                    if message["type"] == "delta":
                        completion += sum(len(out["token_ids"]) for out in message["outputs"])
                        computed = message["num_prompt_tokens"]
                    else:
                        computed = message.get("num_computed_prompt_tokens", 0)
                    if rid not in self._started:  # a read message counted its prompt already
                        prompt[rid] = max(prompt.get(rid, 0), computed)
                    if message["type"] != "delta" or message.get("finished"):
                        answered.add(rid)
                left = deadline - time.monotonic()
                if sent <= answered or left <= 0:
                    break
                self._arrived = asyncio.get_running_loop().create_future()
                await asyncio.wait({self._arrived}, timeout=left)
        finally:
            self._close(LeftBehind(sum(prompt.values()), completion))

    async def __aiter__(self) -> AsyncIterator[Message]:
        while self._unfinished:
            message = await self._next_message()
            rid = message.get("rid")
            if rid not in self._unfinished:
                continue
            self._started.add(rid)
            if message.get("worker"):
                self._owners[rid] = message["worker"]
            self._held[(rid, message.get("seq", 0))] = message
            self._check_gap(rid, message.get("seq", 0))
            while (rid, self._next_seq[rid]) in self._held:
                ready = self._held.pop((rid, self._next_seq[rid]))
                self._next_seq[rid] += 1
                if is_final(ready):
                    self._unfinished.discard(rid)
                yield ready
                if rid not in self._unfinished:
                    break

    def _check_gap(self, rid: str, seq: int) -> None:
        """Raise :class:`WorkerLost` when messages of ``rid`` after a missing one have kept arriving
        for ``GAP_GRACE`` seconds: the missing one was lost (its worker could not publish it while
        Redis was down), and the rest would be held for ever."""
        if seq <= self._next_seq[rid]:
            self._gap_since.pop(rid, None)
            return
        since = self._gap_since.setdefault(rid, time.monotonic())
        if time.monotonic() - since > GAP_GRACE:
            raise WorkerLost("Part of this request's output was lost (the request queue restarted); retry the request.")

    async def _next_message(self) -> Message:
        while not self._pending:
            _raise_if_cancelled(asyncio.current_task())
            self._arrived = asyncio.get_running_loop().create_future()
            waits = {self._arrived} if self._stopped is None else {self._arrived, self._stopped}
            done, _ = await asyncio.wait(waits, timeout=SILENCE_CHECK, return_when=asyncio.FIRST_COMPLETED)
            if self._stopped in done:
                raise ServerStopping("The server is shutting down; retry the request.")
            if not done:
                await self._check_workers_through_outages()
        return self._pending.popleft()

    async def _check_workers_through_outages(self) -> None:
        """:meth:`_check_workers`, with Redis unreachable for up to ``REDIS_OUTAGE_GRACE`` seconds
        taken as a restart to wait for, not as the end of the request (the worker keeps running it,
        and its stream goes on once Redis is back).

        Raises:
            RedisError: Redis has been unreachable for longer than that.
        """
        try:
            await self._check_workers()
        except RedisError:
            now = time.monotonic()
            if self._redis_down_since is None:
                self._redis_down_since = now
            if now - self._redis_down_since > REDIS_OUTAGE_GRACE:
                raise
        else:
            self._redis_down_since = None

    async def _check_workers(self) -> None:
        """Raise :class:`WorkerLost` if a request's worker died, if no worker of the model is
        live while requests wait in the queue, or if a claimed request's claim vanished
        (its worker finished it) without its final message arriving."""
        redis = get_redis()
        rids = sorted(self._unfinished)
        owners = dict(zip(rids, (o.decode() if o else None for o in
                                 await redis.mget([claim_key(r) for r in rids]))))
        await self._enqueue_again_if_lost(redis, owners)
        known = {w["id"] for w in await heartbeating_workers(self.model)}  # shared by the streams
        for owner in set(owners.values()) - {None, worker_registry.ABORTED, worker_registry.REQUEUED} - known:
            if await worker_registry.worker_info(redis, owner) is None:  # not just newer than the shared read
                owned = [rid for rid, o in owners.items() if o == owner]
                if not await self._requeued_or_held(redis, owner, owned):
                    raise WorkerLost(f"The worker serving this request ({owner}) stopped; retry the request.")
                if not await model_workers(self.model):  # nobody left to requeue it (yet)
                    self._no_worker()
        self._owners.update({rid: owner for rid, owner in owners.items()
                             if owner and owner != worker_registry.REQUEUED})
        vanished = [rid for rid, owner in owners.items() if owner is None and rid in self._owners]
        self._unclaimed_strikes = self._unclaimed_strikes + 1 if vanished else 0
        if self._unclaimed_strikes >= 3:
            raise WorkerLost("The worker finished this request but its last messages were lost; retry it.")
        if any(o in (None, worker_registry.REQUEUED) for o in owners.values()) and not await model_workers(self.model):
            self._no_worker()
        elif known:  # some worker of the model is live again
            self._no_worker_since = None

    async def _enqueue_again_if_lost(self, redis: aioredis.Redis, owners: dict[str, str | None]) -> None:
        """Redis lost its data since the requests were enqueued (its epoch changed: a restart
        without persistence): enqueue again those that nothing was heard of and that no worker
        claims. A copy of one that a worker still holds in its engine is harmless: the claim lets
        one of the two run (:func:`.request_queue.take`, :func:`.held.settle`)."""
        now = await epoch(redis)
        if now == self._epoch:
            return
        lost = [self._queued[rid] for rid, owner in owners.items()
                if owner is None and rid not in self._started and rid in self._queued]
        logger.warning("Redis lost its data (a restart?); enqueueing %d requests of this stream again", len(lost))
        if lost:
            _, now, began = await enqueue(redis, self.model, lost)
            if began:
                republish_shares()
        self._epoch = now

    def _no_worker(self) -> None:
        """No worker of the model is live while requests of this stream have not started: they stay
        queued (or held, and requeued by the next worker) for ``NO_WORKER_GRACE`` seconds, in case a
        worker comes back (``serve`` restarts one that died); then :class:`WorkerLost`."""
        now = time.monotonic()
        if self._no_worker_since is None:
            self._no_worker_since = now
        if now - self._no_worker_since > NO_WORKER_GRACE:
            raise WorkerLost(f"No worker is serving model '{self.model}' now; retry later.")

    async def _requeued_or_held(self, redis: aioredis.Redis, owner: str, rids: list[str]) -> bool:
        """Whether every one of ``rids``, claimed by the dead worker ``owner``, had not started
        there: still held by it (the other workers requeue it within seconds), or requeued
        already (its claim moved on; read after the records, since taking a record and moving
        its claim are one step)."""
        records = await redis.hmget(held_key(self.model), rids)
        claims = await redis.mget([claim_key(r) for r in rids])
        for record, claim in zip(records, claims):
            held_by_owner = record is not None and json.loads(record).get("worker") == owner
            if not held_by_owner and (claim is not None and claim.decode() == owner):
                return False
        return True

    async def abort(self, retry_for: float = 0.0) -> set[str]:
        """Abort the unfinished engine requests: those not claimed yet, and those a worker claimed
        but holds unstarted (:func:`.held.abort_held`: even a dead worker, whose records another
        worker would requeue), are marked so that no worker starts them; the owners of the
        claimed ones get an abort on their control channel. From ``DROP_QUEUED_MIN`` unclaimed
        ones on, their messages are also taken off the queue (:func:`.request_queue.drop_queued`).

        ``retry_for``: seconds for which an abort that fails because Redis is unreachable (a
        restart) is tried again, so that it takes effect once Redis is back; 0: raise at once.

        Returns:
            The requests whose abort went to a worker (each answers with an *aborted* message on the reply
            channel, :mod:`.messages`).
        Raises:
            RedisError: Redis could not be reached (and ``retry_for`` ran out).
        """
        if not self._unfinished:
            return set()
        rids = sorted(self._unfinished)
        self._unfinished.clear()
        deadline, delay = time.monotonic() + retry_for, 0.1
        while True:
            try:
                return await self._abort(rids)
            except (RedisError, OSError) as error:
                if time.monotonic() + delay > deadline:
                    if retry_for:
                        logger.warning("aborting %d requests failed for %.0f s (%s); giving up", len(rids),
                                       retry_for, type(error).__name__)
                    raise
                await asyncio.sleep(delay)
                delay = min(2 * delay, ABORT_RETRY_MAX_DELAY)

    async def _abort(self, rids: list[str]) -> set[str]:
        redis = get_redis()
        pipe = redis.pipeline(transaction=False)
        for rid in rids:  # not claimed, or requeued: no worker starts it now
            await worker_registry.claim(pipe, rid, worker_registry.ABORTED, client=pipe)
        marks = await pipe.execute()
        claimed = [rid for rid, marked in zip(rids, marks) if not marked]
        unclaimed = {rid for rid, marked in zip(rids, marks) if marked}
        if len(unclaimed) >= DROP_QUEUED_MIN:  # a large batch: its messages leave the queue too
            for queue in self._queues:
                await drop_queued(redis, queue, sorted(unclaimed))
        by_worker: dict[str, list[str]] = {}
        for rid in sorted(unclaimed):  # started, but its claim was lost (a Redis restart): abort it where it runs
            if rid in self._owners:
                by_worker.setdefault(self._owners[rid], []).append(rid)
        if claimed:
            for rid, owner in zip(claimed, await redis.mget([claim_key(r) for r in claimed])):
                if owner and owner.decode() != worker_registry.ABORTED:
                    by_worker.setdefault(owner.decode(), []).append(rid)
            pipe = redis.pipeline(transaction=False)
            for rid in claimed:  # held unstarted by a live or a dead worker: it never starts now
                await held.abort_held(pipe, self.model, rid, client=pipe)
            await pipe.execute()
        sent: set[str] = set()
        for worker_id, owned in by_worker.items():
            info = await worker_registry.worker_info(redis, worker_id)
            if info and info.get("control"):
                await self.layer.send(info["control"], Abort(tuple(owned), self.reply).encode())
                sent.update(owned)
        return sent


_background: set[asyncio.Future] = set()  # aborts and share republishing, referenced until done


def republish_shares() -> None:
    """Write the tenants' GPU shares and the registered LoRA adapters to Redis again, in the background (from
    the database; for a Redis that lost them in a restart). Returns at once."""
    from asgiref.sync import sync_to_async  # noqa: PLC0415

    from tenants.shares import publish  # noqa: PLC0415 (the tenants app imports the serving layer)
    from webapp.catalog.lora import publish as publish_adapters  # noqa: PLC0415

    def publish_both() -> None:
        publish()
        publish_adapters()

    task = asyncio.ensure_future(sync_to_async(publish_both, thread_sensitive=False)())
    _background.add(task)  # kept referenced until done
    task.add_done_callback(_background.discard)
    task.add_done_callback(retrieve_exception)


def _raise_if_cancelled(task: asyncio.Task | None) -> None:
    """Raise ``CancelledError`` if ``task`` was cancelled (Django cancels a request's task when its
    client disconnects) but goes on: asgiref's ``sync_to_async`` (the ORM's tenant lookups) lets its
    thread finish and then returns normally, swallowing a cancellation that arrived meanwhile. Seen:
    a batch whose client left at once was enqueued and generated in full."""
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()
