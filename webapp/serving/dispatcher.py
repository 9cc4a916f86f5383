"""The worker's dequeue: one thread that takes the served model's requests from Redis into the
engine, in the order of the tenants' GPU shares.

Why a thread of the worker's own and not Celery's consumer: Celery takes from a worker's
queues in turn (round robin), so the engine's backlog held the tenants 50/50 whatever their
shares, and when a wave of equally long requests ended together the scheduler admitted the
whole backlog at once with nothing to choose between (a 30% tenant got 50%). Here the worker
takes a request only when its engine has a place for it (running, or waiting in the
backlog of ``max_waiting_requests``), and which tenant's queue it takes from is decided in
Redis by counters shared with every worker of the model (:mod:`.request_queue`), so what
enters the engines already follows the shares, at any backlog depth and on any number of
workers. Taking, claiming and recording a request as held are one atomic step, so a worker
killed at any moment loses no request: the others requeue what it held (:mod:`.held`).

A full engine still keeps every tenant with queued requests present in its backlog: when the
tenant whose turn it is has no request waiting in the engine, one not-yet-started request of a
tenant with several goes back to the head of its queue (its charge refunded) to make room
(:meth:`.EngineLoop.displace_for`). So a tenant that arrives into another's flood is admitted
at the engine's next admission, not after the whole backlog.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import redis
from redis.exceptions import RedisError

from webapp.transport.keys import claim_key
from webapp.transport.wire import InvalidParams

from . import held, request_queue
from .engine_loop import EngineLoop, EngineRequest
from .io_loop import WorkerIO
from .request_queue import CLAIMED, QueuedRequest, Taken

logger = logging.getLogger(__name__)

FULL_POLL = 0.05  # seconds between checks while the engine has no place
ROOM_CHECK = 0.2  # seconds between two looks at whose turn it is while the engine is full
IDLE_WAIT = 0.25  # seconds an idle worker blocks on the doorbell before looking at the queues anyway
RETRY_DELAY = 0.5  # seconds after a Redis error
DISPLACED = "The request could not be kept waiting on this worker; retry the request."


def give_back(client: redis.Redis, model: str, record: dict) -> None:
    """Put a taken held record's request (:func:`.held.take`) back at the head of its queue and
    refund its charge; a record whose client aborted it is only refunded."""
    try:
        request = QueuedRequest.decode(record["payload"])
    except InvalidParams as invalid:  # requeued as it is: the worker that takes it answers the 400
        request = invalid.request
    if record.get("aborted"):
        request_queue.refund(client, model, request.tenant, float(record["charge"]))
    else:
        request_queue.requeue(client, model, record["payload"], request.tenant, float(record["charge"]))


class Dispatcher(threading.Thread):
    """Feeds one engine loop from its model's queues (see the module docstring).

    Args:
        redis_url: the Redis of the queues.
        model: the served model's name.
        worker_id: this worker's id (its claims and held records).
        loop: the engine loop; a place in it is taken (:meth:`EngineLoop.acquire_slot`) before each
            request, and given back when the request ends.
        io: the worker's I/O thread, whose ledger (:mod:`.ledger`) takes each request.
    """

    def __init__(self, redis_url: str, model: str, worker_id: str, loop: EngineLoop, io: WorkerIO) -> None:
        super().__init__(name="tessera-dispatcher", daemon=True)
        self.model = model
        self.worker_id = worker_id
        self.loop = loop
        self.io = io
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=30)
        self._stopping = threading.Event()
        self._next_room_check = 0.0
        self._failing = False

    def stop(self, timeout: float = 5.0) -> None:
        """Take no more requests; returns once the thread ended (or after ``timeout`` seconds)."""
        self._stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    def run(self) -> None:
        while not self._stopping.is_set() and self.loop.is_alive():
            try:
                self._step()
                self._failing = False
            except RedisError as error:
                if not self._failing:  # once per outage
                    logger.warning("taking requests from the queue failed (%s); retrying", type(error).__name__)
                self._failing = True
                self._stopping.wait(RETRY_DELAY)

    def _step(self) -> None:
        if not self.loop.acquire_slot(FULL_POLL):
            self._make_room()
            return
        try:
            taken = None if self._stopping.is_set() else request_queue.take(self._redis, self.model, self.worker_id)
        except BaseException:
            self.loop.release_slot()
            raise
        if taken is None:
            self.loop.release_slot()
            if not self._stopping.is_set():
                request_queue.wait_doorbell(self._redis, self.model, IDLE_WAIT)
            return
        self._start(taken)

    def _start(self, taken: Taken) -> None:
        """Hand a taken request to the engine loop (its place is held)."""
        request = taken.request
        if taken.status != CLAIMED:  # its client left before any worker took it, or another worker has it
            self.loop.release_slot()
            return
        running = self.io.ledger.get(request.rid)
        if running is not None:  # a copy of one this worker has (enqueued again after Redis lost its data)
            self.loop.release_slot()
            request_queue.refund(self._redis, self.model, request.tenant, taken.charge)
            if not running.held:  # its held record, written by the take, must not outlive it
                held.release(self._redis, self.model, self.worker_id, request.rid)
            return
        self.io.ledger.open(request, taken.charge, taken.message)  # its first message (even an error) settles it
        if taken.invalid is not None:  # sent by a web process of another version
            self.loop.release_slot()
            self.io.reject(request.rid, 400, str(taken.invalid.error), taken.invalid.param)
            return
        arrival = time.monotonic() - max(0.0, time.time() - request.arrival)
        self.loop.submit(EngineRequest(request.rid, list(request.prompt_token_ids), request.params, arrival,
                                       request.tenant, priority=int(request.priority), cache_salt=request.cache_salt,
                                       lora_name=request.lora_name, lora_path=request.lora_path))

    def _make_room(self) -> None:
        """The engine is full: if the tenant whose turn it is has no request waiting in it, give
        back one of a tenant with several and take the turn's request in its place."""
        now = time.monotonic()
        if now < self._next_room_check or self._stopping.is_set():
            return
        self._next_room_check = now + ROOM_CHECK
        found, tenant = request_queue.next_tenant(self._redis, self.model)
        if not found:
            return
        displaced = self.loop.displace_for(tenant)
        if displaced is None:
            return
        self._give_back(displaced)  # its place is ours now
        taken = request_queue.take(self._redis, self.model, self.worker_id, tenant, only_tenant=True)
        if taken is None:  # another worker took it meanwhile
            self.loop.release_slot()
            return
        self._start(taken)

    def _give_back(self, request_id: str) -> None:
        """Put a backlogged request that the engine dropped unstarted back on the queue (its claim
        becomes ``requeued``; its client keeps waiting)."""
        record = held.take(self._redis, self.model, self.worker_id, request_id)
        entry = self.io.ledger.get(request_id)
        if record is None and entry is not None and self._redis.get(claim_key(request_id)) in (
                None, self.worker_id.encode()):  # Redis lost its record (a restart): the ledger has it
            record = {"payload": entry.payload, "charge": entry.charge}
        if record is not None:
            self.io.forget(request_id)
            give_back(self._redis, self.model, record)
        else:  # another worker took it over meanwhile (this one looked dead for a moment)
            self.io.reject(request_id, 503, DISPLACED, None)  # dropped at publishing if taken over


def reclaimer(redis_url: str, model: str) -> held.OrphanReclaimer:
    """The thread that puts the held requests of ``model``'s dead workers back on their queues."""
    client = redis.Redis.from_url(redis_url, socket_timeout=30)
    requeue: Callable[[dict], None] = lambda record: give_back(client, model, record)  # noqa: E731
    return held.OrphanReclaimer(client, model, requeue)
