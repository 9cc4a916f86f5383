"""The worker's I/O thread: one asyncio loop that does all of a worker's Redis traffic.

* publishes engine outputs: everything that piled up while the previous publish was in
  flight is coalesced per request and written with one pipeline
  (:func:`webapp.transport.channel_layer.bulk_send`), so a slow Redis delays delivery but never
  the engine loop;
* settles the held record of a request (:mod:`.held`) before publishing its first output or
  error, and drops (aborts) a request that another worker took over meanwhile;
* receives aborts on the worker's control channel and passes them to the engine loop, answering each
  request with the engine's count of its computed prompt once the engine dropped it (an *aborted*
  message, :mod:`.messages`), and LoRA adapter
  checks, which it answers once the engine loaded the adapter or refused it (:mod:`.lora_registry`);
* writes the heartbeat (worker info, engine stats, the recent figures of :mod:`.recent_stats`)
  every ``HEARTBEAT_INTERVAL`` seconds,
  adds what the worker's counters and histograms grew by to its model's totals
  (:mod:`.worker_metrics`), also once more when it stops or its model is unloaded, and reads
  the tenants' GPU shares (:mod:`.tenant_shares`) and the registered LoRA adapters (:mod:`.lora_registry`),
  passing them on when they changed;
* logs the engine's throughput and load every ``LOG_INTERVAL`` seconds (:mod:`.stat_logger`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable

from channels_redis.core import RedisChannelLayer
from redis.exceptions import RedisError

from webapp.transport.channel_layer import CONTROL_CHANNEL_PREFIX, bulk_send
from webapp.transport.keys import LORA_ADAPTERS_KEY, SHARES_KEY, WORKERS_KEY, claim_key, worker_key

from . import held, worker_registry
from .lora_registry import AdapterEntry, LoRACheck, answer_check, decode_registry, wait_result
from .ledger import RequestLedger
from .messages import Abort, Aborted, aborted_message, coalesce, encode_output, error_message, is_final
from .recent_stats import RecentStats
from .request_queue import epoch
from .stat_logger import LOG_INTERVAL, StatLogger
from .tenant_shares import TenantShares, decode_shares
from .worker_metrics import CounterDeltas, RequestMetrics, flat_totals

logger = logging.getLogger(__name__)

CONTROL_RETRY = 0.5  # seconds between two tries to receive aborts while Redis is unreachable
PUBLISH_RETRY = 0.5  # seconds between two tries to publish while Redis is unreachable


class WorkerIO(threading.Thread):
    """Owns the worker's Redis I/O; other threads call only the thread-safe methods.

    Args:
        worker_id: this worker's id (heartbeat and claim values).
        layer: the Channels layer (a ``RedisChannelLayer``) used only from this thread.
        info: returns the heartbeat's info dict (called on this thread).
        on_abort: called with a list of request ids the clients abandoned.
        on_shares: called with the tenants' ``TenantShares`` when they changed in Redis.
        on_loras: called with the registered LoRA adapters (``name -> AdapterEntry``) when they changed.
        on_lora_check: called with an adapter's name and path to load; returns the engine loop's future
            (``EngineLoop.add_lora``), or None without an engine.
    """

    def __init__(self, worker_id: str, layer: RedisChannelLayer, info: Callable[[], dict[str, Any]],
                 on_abort: Callable[[list[str]], None],
                 on_shares: Callable[[TenantShares], None] | None = None,
                 on_loras: Callable[[dict[str, AdapterEntry]], None] | None = None,
                 on_lora_check: Callable[[str, str], concurrent.futures.Future | None] | None = None) -> None:
        super().__init__(name="tessera-worker-io", daemon=True)
        self.worker_id = worker_id
        self.layer = layer
        self.metrics = RequestMetrics()
        self.recent = RecentStats(self.metrics)
        self._deltas = CounterDeltas()
        self._stat_logger = StatLogger()
        self._next_log = 0.0
        self.control_channel: str | None = None
        self._info = info
        self._on_abort = on_abort
        self._on_shares = on_shares
        self._shares: TenantShares | None = None
        self._on_loras = on_loras
        self._on_lora_check = on_lora_check
        self._loras: dict[str, AdapterEntry] | None = None
        self._checks: set[asyncio.Task] = set()
        self.ledger = RequestLedger()  # the requests this worker took, until they end
        self._carry: list[tuple[str, Any, float | None]] = []  # outputs not published yet (Redis was down)
        self._unsent: list[tuple[str, dict]] = []  # numbered messages not sent yet (Redis was down)
        self._unsent_cleanup: list[tuple[str, tuple, dict]] = []
        self._publish_failing = False
        self._epoch: str | None = None  # Redis's epoch at the last heartbeat (request_queue.epoch)
        self._loop = asyncio.new_event_loop()
        self._queue: asyncio.Queue | None = None
        self._ready = threading.Event()
        self._stopping = False

    # ---- thread-safe API -------------------------------------------------------------
    def start_and_wait(self, timeout: float = 30.0) -> None:
        self.start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if not self.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the worker's I/O thread did not start (is Redis reachable?)")

    def forget(self, request_id: str) -> None:
        """``request_id`` left this worker before it started (given back to the queue): publish
        nothing of it, and do not settle its record (the taker of the record did)."""
        self.ledger.leave(request_id)

    def publish(self, outputs: list, step_time: float) -> None:
        """Queue one step's outputs for publishing; returns at once (engine loop side)."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, ("outputs", outputs, step_time))

    def aborted(self, computed: dict[str, int]) -> None:
        """The engine dropped these requests at their clients' aborts, having computed so many prompt tokens
        of each: their tenants' counters are corrected with the next batch, and the counts sent to their web
        processes (which charge them to the tenants' limits and usage); returns at once."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, ("aborted", computed, None))

    def reject(self, request_id: str, status: int, message: str, param: str | None) -> None:
        """End a request with an error message to its client; returns at once."""
        self._loop.call_soon_threadsafe(
            self._queue.put_nowait, ("error", error_message(request_id, status, message, param), None))

    def heartbeat_now(self, timeout: float = 5.0) -> None:
        """Publish the heartbeat at once (a state change that readers must see before what
        follows it, e.g. an unload before its requests' errors). Blocks until written."""
        asyncio.run_coroutine_threadsafe(self._heartbeat_once(), self._loop).result(timeout)

    def end_model(self, timeout: float = 10.0) -> None:
        """The engine has stopped and its model goes: publish what is queued (the errors to
        its requests), add its last counter increments to its model's totals, and start the
        request metrics and counters afresh for the next model. Blocks until done."""
        done = asyncio.run_coroutine_threadsafe(self._end_model(), self._loop)
        done.result(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Flush what is queued, remove the heartbeat, end the thread."""
        if self.is_alive():
            done = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            try:
                done.result(timeout)
            except (TimeoutError, concurrent.futures.TimeoutError):
                done.cancel()  # the heartbeat then expires by itself (its TTL) instead of being removed
                logger.warning("the I/O thread did not flush and deregister within %.0f s; stopping anyway", timeout)
            self.join(timeout)

    # ---- the loop ------------------------------------------------------------------
    def run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._queue = asyncio.Queue()
        self.control_channel = await self.layer.new_channel(CONTROL_CHANNEL_PREFIX)
        await self._heartbeat_once()
        tasks = [asyncio.ensure_future(c) for c in (self._publisher(), self._control(), self._heartbeat())]
        self._ready.set()
        self._tasks = tasks
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _shutdown(self) -> None:
        # The control task is cancelled last: a receive cancelled in the middle of its
        # blocking pop holds the layer's connection up to the pop's timeout (5 s), which
        # used to stall (and, past stop's timeout, lose) the last counter increments.
        self._stopping = True
        self._tasks[2].cancel()
        await asyncio.gather(self._tasks[2], return_exceptions=True)
        await self._queue.put(("flush", None, None))
        try:
            await asyncio.wait_for(self._tasks[0], 3.0)
        except asyncio.TimeoutError:
            self._tasks[0].cancel()
        redis = self.layer.connection(0)
        try:
            await self._push_counters(self._info())
        except Exception:
            logger.exception("final metrics push failed")
        await redis.delete(worker_key(self.worker_id))
        await redis.zrem(WORKERS_KEY, self.worker_id)
        self._tasks[1].cancel()

    async def _end_model(self) -> None:
        finished = self._loop.create_future()
        await self._queue.put(("end_model", finished, None))
        await finished

    async def _publisher(self) -> None:
        """Publish what the engine loop queued. While Redis is unreachable nothing is lost or
        skipped: outputs whose held records could not be settled are kept and tried again with
        the next batch (at least every ``PUBLISH_RETRY`` seconds), and messages that could not be
        sent are sent first next time (:meth:`_send`), so a stream sees a pause, not a gap."""
        while True:
            if self._carry or self._unsent:
                try:
                    batch = [await asyncio.wait_for(self._queue.get(), PUBLISH_RETRY)]
                except asyncio.TimeoutError:
                    batch = []
            else:
                batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            reports = []  # (reply channel, aborted message): the engine's counts of the requests clients left
            for kind, value, _ in batch:
                if kind == "aborted":
                    reports += [(channel, aborted_message(rid, tokens)) for rid, tokens in value.items()
                                if (channel := self.ledger.aborted(rid, tokens)) is not None]
                elif kind == "reports":
                    reports += value
            outputs = self._carry + [item for item in batch if item[0] in ("outputs", "error")]
            self._carry = []
            try:
                await self._publish(outputs, reports)
            except (RedisError, OSError) as error:  # settling failed: none of them went out
                self._carry = outputs
                self._unsent += reports
                self._redis_failing(error)
            except Exception:
                logger.exception("publishing %d items failed", len(outputs))
            for kind, finished, _ in batch:
                if kind == "end_model":
                    await self._reset_model_metrics()
                    finished.set_result(None)
            if self._stopping and any(kind == "flush" for kind, _, _ in batch):
                return

    async def _publish(self, batch: list[tuple[str, Any, float | None]],
                       reports: list[tuple[str, Aborted]] = ()) -> None:
        messages = []
        for kind, value, step_time in batch:
            if kind == "outputs":
                messages += [(encode_output(out), step_time) for out in value]
            elif kind == "error":
                messages.append((value, None))
        lost = await self._settle({m["rid"] for m, _ in messages})
        if lost:
            messages = [(m, t) for m, t in messages if m["rid"] not in lost]
        for message, step_time in messages:
            if message["type"] == "delta":
                self._observe(message, step_time)
                self.ledger.on_output(message["rid"], message["num_prompt_tokens"],
                                      sum(len(o["token_ids"]) for o in message["outputs"]))
        items, cleanup = [], []
        for message in coalesce([m for m, _ in messages]):
            rid = message["rid"]
            route = self.ledger.next_message(rid)
            if route is None:  # the client left, or it is not this worker's: nobody listens
                continue
            channel, message["seq"] = route
            message["worker"] = self.worker_id  # who runs it, for the client's aborts and checks (a claim can be lost)
            items.append((channel, message))
            if is_final(message):
                self.ledger.end(rid)
                # Kept a while, not deleted: a copy enqueued again (Redis lost its data) must find it claimed.
                cleanup.append(("expire", (claim_key(rid), worker_registry.CLAIM_DONE_TTL), {}))
        cleanup += self.ledger.counter_commands()
        await self._send(items + list(reports), cleanup)

    async def _send(self, items: list[tuple[str, dict]], cleanup: list[tuple[str, tuple, dict]]) -> None:
        """Send numbered messages (and Redis commands), after those a failed send kept; when Redis
        is unreachable, keep them all for the next try."""
        items, cleanup = self._unsent + items, self._unsent_cleanup + cleanup
        self._unsent, self._unsent_cleanup = [], []
        if not items and not cleanup:
            return
        try:
            await bulk_send(self.layer, items, cleanup)
        except (RedisError, OSError) as error:
            self._unsent, self._unsent_cleanup = items, cleanup
            self._redis_failing(error)
            return
        if self._publish_failing:
            logger.info("publishing again (%d messages kept while Redis was unreachable)", len(items))
            self._publish_failing = False

    def _redis_failing(self, error: BaseException) -> None:
        if not self._publish_failing:
            logger.warning("publishing failed (%s); keeping the outputs until Redis is back", type(error).__name__)
        self._publish_failing = True

    async def _settle(self, request_ids: set[str], aborted: bool = False) -> set[str]:
        """Remove the held records of those of ``request_ids`` still held (about to publish their
        first message); returns those another worker took over or their clients aborted (their
        claims no longer name this worker): they are aborted here and nothing of them is
        published. ``aborted``: the requests' clients left (an abort message), so losing them is
        expected and not logged.

        Raises:
            RedisError: Redis could not be reached (the records stand; the next message tries again).
        """
        holding = self.ledger.held(request_ids)
        if not holding:
            return set()
        rids = sorted(holding)
        pipe = self.layer.connection(0).pipeline(transaction=False)
        for rid in rids:
            await held.settle(pipe, holding[rid], self.worker_id, rid, client=pipe)
        settled = dict(zip(rids, await pipe.execute()))
        lost = {rid for rid, mine in settled.items() if mine != 1}
        for rid in rids:
            if settled[rid] == -1:  # its client left while it prefilled here: the engine's count charges it
                self.ledger.client_left(rid)
                self.ledger.settled(rid)
            elif rid in lost and not aborted:
                self.ledger.leave(rid)
            else:
                self.ledger.settled(rid)
        if lost and not aborted:
            logger.warning("requests %s were taken over by another worker, or aborted by their clients, before "
                           "they started here; dropped", sorted(lost))
            self._on_abort(sorted(lost))
        return lost

    def _observe(self, message: dict, step_time: float) -> None:
        outputs = message["outputs"]
        self.metrics.on_delta(message["rid"], sum(len(o["token_ids"]) for o in outputs), step_time,
                              message["metrics"], message["finished"], [o["finish_reason"] for o in outputs],
                              message.get("num_prompt_tokens"))

    async def _control(self) -> None:
        """Receive aborts until the thread stops. A Redis error (a restart, a network cut) is
        logged once and the receive retried every ``CONTROL_RETRY`` seconds, so that aborts work
        again as soon as Redis is back; those sent meanwhile are retried by their web process
        (:mod:`webapp.serving.client`)."""
        failing = False
        while True:
            try:
                message = await self.layer.receive(self.control_channel)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 (RedisError, or the layer's own on a lost connection)
                if not failing:
                    logger.warning("receiving aborts failed (%s); retrying every %.1f s", type(error).__name__,
                                   CONTROL_RETRY)
                failing = True
                await asyncio.sleep(CONTROL_RETRY)
                continue
            if failing:
                logger.info("receiving aborts again")
                failing = False
            check = LoRACheck.decode(message)
            if check is not None:
                self._background(self._answer_check(check))
                continue
            abort = Abort.decode(message)
            if abort is not None:
                rids = list(abort.rids)
                unknown = [rid for rid in rids if not self.ledger.client_left(rid)]
                for rid in rids:
                    self.metrics.forget(rid)
                if unknown and abort.reply:  # ended, or never here: nothing of them is computed any more
                    await self._queue.put(("reports", [(abort.reply, aborted_message(rid, 0)) for rid in unknown],
                                           None))
                self._on_abort(rids)
                try:  # aborted before it started: its held record goes (nothing is published for it)
                    await self._settle(set(rids), aborted=True)
                except Exception:
                    logger.exception("removing the held records of aborted requests failed")

    async def _answer_check(self, check: LoRACheck) -> None:
        """Load the adapter of ``check`` into the engine (on the engine loop, between steps) and answer."""
        try:
            future = self._on_lora_check(check.name, check.path) if self._on_lora_check else None
            await answer_check(self.layer.connection(0), check, await wait_result(future))
        except Exception:
            logger.exception("answering the check of LoRA adapter %s failed", check.name)

    def _background(self, coroutine) -> None:
        task = self._loop.create_task(coroutine)
        self._checks.add(task)  # referenced until done
        task.add_done_callback(self._checks.discard)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(worker_registry.HEARTBEAT_INTERVAL)
            try:
                await self._heartbeat_once()
            except Exception:
                logger.exception("heartbeat failed")

    async def _reset_model_metrics(self) -> None:
        try:
            await self._push_counters(self._info())
        except Exception:
            logger.exception("the unloaded model's last metrics push failed")
        self.metrics = RequestMetrics()
        self.recent = RecentStats(self.metrics)
        self._deltas = CounterDeltas()
        self._stat_logger.reset()

    async def _restore_if_redis_lost_data(self) -> None:
        """When Redis lost its data (its epoch changed: a restart without persistence), write
        again the claims of this worker's requests and the held records of those not started, so
        that their clients keep waiting for them and no copy of them runs elsewhere."""
        now = await epoch(self.layer.connection(0))
        if self._epoch is not None and now != self._epoch:
            commands = self.ledger.restore_commands(self.worker_id, worker_registry.CLAIM_TTL)
            if commands:
                await bulk_send(self.layer, [], commands)
            logger.warning("Redis lost its data (a restart?); restored the claims of this worker's requests")
        self._epoch = now

    async def _heartbeat_once(self) -> None:
        await self._restore_if_redis_lost_data()
        info = dict(self._info(), id=self.worker_id, control=self.control_channel, time=time.time())
        info["recent"] = self.recent.sample(info["stats"])
        await bulk_send(self.layer, [], worker_registry.heartbeat_commands(self.worker_id, info)
                        + self.ledger.counter_commands())
        await self._push_counters(info)
        self._log_stats(info)
        if self._on_shares is not None:
            shares = decode_shares(await self.layer.connection(0).hgetall(SHARES_KEY))
            if shares != self._shares:
                self._shares = shares
                self._on_shares(shares)
        if self._on_loras is not None:
            loras = decode_registry(await self.layer.connection(0).hgetall(LORA_ADAPTERS_KEY))
            if loras != self._loras:
                self._loras = loras
                self._on_loras(loras)

    def _log_stats(self, info: dict[str, Any]) -> None:
        now = time.monotonic()
        if now < self._next_log or not info.get("model") or not info.get("stats"):
            return
        self._next_log = now + LOG_INTERVAL
        line = self._stat_logger.line(info["stats"], now)
        if line is not None:
            logger.log(logging.DEBUG if self._stat_logger.quiet else logging.INFO, "%s: %s", info["model"], line)

    async def _push_counters(self, info: dict[str, Any]) -> None:
        """Add what the counters grew by since the last push to the model's totals (one
        MULTI/EXEC; on failure the increments stay for the next push). Nothing without a model."""
        if not info.get("model"):
            return
        totals = flat_totals(info["stats"], self.metrics)
        increments = self._deltas.since_commit(totals)
        if not increments:
            return
        pipe = self.layer.connection(0).pipeline(transaction=True)
        for method, args, kwargs in worker_registry.counter_increment_commands(info["model"], increments):
            getattr(pipe, method)(*args, **kwargs)
        await pipe.execute()
        self._deltas.commit(totals)
