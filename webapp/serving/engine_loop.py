"""The engine step loop of a worker, in its own thread, free of any I/O.

Other threads talk to it only through a thread-safe inbox (requests to add, ids to abort);
it hands each step's outputs to a callback that must not block (the I/O thread's queue).
Between two steps it drains the whole inbox, so an abort reaches ``abort_request`` before
the next step: a client that leaves costs at most the step already running.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from inference.errors import InvalidRequestError, NotSupportedYetError
from inference.sampling_params import SamplingParams

from .lora_adapters import EngineAdapters

logger = logging.getLogger(__name__)
# the parameters an adapter's own load errors name (inference.lora.checkpoint): not the request's fault
_ADAPTER_PARAMS = frozenset({"lora_path", "max_lora_rank", "target_modules", "lora_int_id"})

IDLE_POLL = 0.2  # seconds an idle loop waits on its inbox before refreshing stats
ABORT_MEMORY = 120.0  # seconds an abort for a request not seen yet is remembered


@dataclass(frozen=True)
class EngineRequest:
    """One request handed to the engine loop.

    Attributes:
        request_id: the engine request id (unique across the cluster).
        prompt_token_ids: tokenized prompt, list of int.
        params: validated sampling parameters.
        arrival_time: ``time.monotonic`` seconds at which the web process received it.
        tenant_id: the tenant's slug (its GPU share in the scheduler), or None.
        priority: scheduling priority (lower runs earlier; the ``priority`` policy only).
        cache_salt: prefix-cache key (one per tenant), None to share with every unsalted request.
        lora_name: the LoRA adapter it runs with (the name the client sent as ``model``), None for the base model.
        lora_path: that adapter's folder, as registered (:mod:`.lora_adapters`).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    tenant_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None


class EngineLoop(threading.Thread):
    """Runs ``engine.step()`` while there is work; the only thread that touches the engine.

    The engine is built on this thread (``engine_factory``): CPU kernels run about 20% slower
    when stepped from a thread other than the one that built the engine (its OpenMP team was
    created there).

    Args:
        engine_factory: returns an ``inference.LLMEngine``; called once, on this thread.
        on_outputs: called with ``(outputs, step_end_time)`` after every step that produced
            outputs; must return at once.
        on_rejected: called with ``(request_id, status, message, param)`` when the engine
            refuses a request or fails; must return at once.
        capacity: requests the engine may hold at once, running or waiting (the scheduler's
            ``max_num_seqs`` plus the worker's backlog); :meth:`acquire_slot` blocks beyond it.
        on_failure: called (on this thread) after the engine raised and every request got an error.
        on_aborted: called with ``{request_id: prompt tokens computed}`` for the requests of each abort
            (0 for those the engine did not hold); must return at once.
    """

    def __init__(self, engine_factory: Callable[[], Any], on_outputs: Callable[[list, float], None],
                 on_rejected: Callable[[str, int, str, str | None], None], capacity: int,
                 on_failure: Callable[[BaseException], None] | None = None,
                 on_aborted: Callable[[dict[str, int]], None] | None = None) -> None:
        super().__init__(name="tessera-engine-loop", daemon=True)
        self._engine_factory = engine_factory
        self.engine: Any = None
        self.adapters: EngineAdapters | None = None  # the engine's LoRA adapters (built with it)
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._on_outputs = on_outputs
        self._on_rejected = on_rejected
        self._on_failure = on_failure
        self._on_aborted = on_aborted
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 request, got {capacity}")
        self.capacity = capacity
        self._slots = threading.Semaphore(capacity)
        self._active: set[str] = set()
        self._early_aborts: dict[str, float] = {}
        self._stopping = threading.Event()
        self._ended = threading.Event()  # the loop stopped stepping: aborts are reported at once
        self._ending = threading.Lock()  # an abort is queued before the end, or reported at once: never lost
        self._stop_reason = "The worker is shutting down."
        self.tenant_shares: Any = None  # the TenantShares the engine runs on (set_tenant_shares)
        self.stats: Any = None
        self.failed: BaseException | None = None
        self.num_steps = 0

    # ---- called from other threads -------------------------------------------------
    def start_and_wait(self) -> Any:
        """Start the thread and wait until it has built the engine; returns the engine.

        Raises:
            whatever ``engine_factory`` raised.
        """
        self.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        return self.engine

    def acquire_slot(self, timeout: float) -> bool:
        """Reserve a place for one request in the engine, running or waiting (False after
        ``timeout`` seconds without one)."""
        return self._slots.acquire(timeout=timeout)

    def release_slot(self) -> None:
        self._slots.release()

    def displace_for(self, tenant_id: str | None) -> str | None:
        """The engine is full: make room for a request of ``tenant_id`` if the scheduler holds no
        waiting (not yet started) request of that tenant, by taking out the latest waiting
        request of the tenant with the most of them, if it has at least two. Blocks until the
        loop has decided (at most one step).

        Why: the scheduler applies the shares only between the tenants it holds requests of; a
        tenant arriving into another's flood would otherwise wait for the whole backlog to drain
        before its first request is even seen. The backlog's mix is left to the dequeue
        (:mod:`.dispatcher`), which already follows the shares.

        Returns:
            the id of the request taken out (aborted here; its place is now the caller's: do
            not acquire one, and give the request back to the queue), or None (nothing to
            displace, or the loop stopped).
        """
        decided: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("displace", (tenant_id, decided)))
        while not decided.done() and self.is_alive() and not self._stopping.is_set():
            concurrent.futures.wait([decided], IDLE_POLL)
        return decided.result() if decided.done() else None

    def submit(self, request: EngineRequest) -> None:
        """Queue a request whose slot the caller holds; the loop adds it before its next step."""
        self._inbox.put(("add", request))

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests before the next step (unknown ids are remembered for a while). Once the loop has
        ended, the requests are reported at once with no prompt computed (``on_aborted``)."""
        with self._ending:
            ended = self._ended.is_set()
            if not ended:
                self._inbox.put(("abort", list(request_ids)))
        if ended:
            self._report_aborted(dict.fromkeys(request_ids, 0))

    def _report_aborted(self, computed: dict[str, int]) -> None:
        if self._on_aborted is not None and computed:
            self._on_aborted(computed)

    def set_tenant_shares(self, shares: Any) -> None:
        """Hand new tenant GPU shares (a ``tenant_shares.TenantShares``) to the engine before its next step."""
        self._inbox.put(("shares", shares))

    def add_lora(self, name: str, path: str) -> concurrent.futures.Future:
        """Load LoRA adapter ``name`` from ``path`` before the next step; the future's result is None once
        loaded, or its exception the engine's refusal (``InvalidRequestError`` naming the parameter)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("lora_add", (name, path, done)))
        return done

    def sync_loras(self, registered: dict[str, str]) -> None:
        """The model's runtime adapters (name -> path) changed: load the new ones, unload the others."""
        self._inbox.put(("lora_sync", dict(registered)))

    def stop(self, reason: str | None = None) -> None:
        """Abort everything and end the loop (returns at once; join the thread to wait).

        ``reason``: the error message its running requests end with (503); default: the
        worker is shutting down.
        """
        if reason is not None:
            self._stop_reason = reason
        self._stopping.set()
        self._inbox.put(("stop", None))

    # ---- the loop ---------------------------------------------------------------
    def run(self) -> None:
        try:
            self.engine = self._engine_factory()
            self.adapters = EngineAdapters(self.engine)
            self.stats = self.engine.get_stats()
        except BaseException as error:
            self._build_error = error
            self._end()
            return
        finally:
            self._built.set()
        try:
            while not self._stopping.is_set():
                busy = self.engine.has_unfinished_requests()
                self._drain_inbox(block=not busy)
                if self._stopping.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self.num_steps += 1
                    if outputs:
                        self._finish(outputs)
                        self._on_outputs(outputs, time.monotonic())
                self.stats = self.engine.get_stats()
        except BaseException as error:  # the engine failed: every request gets an error
            logger.exception("engine loop failed")
            self.failed = error
        finally:
            reason = f"The engine failed: {self.failed}" if self.failed else self._stop_reason
            for rid in list(self._active):
                self._on_rejected(rid, 503, reason, None)
            self._abort_all()
            self._end()
            self.engine.close()  # ends its tensor-parallel rank processes, if any
            if self.failed is not None and self._on_failure is not None:
                self._on_failure(self.failed)

    def _end(self) -> None:
        """Stop taking aborts into the inbox; report those already sent (their charges are corrected)."""
        with self._ending:
            self._ended.set()
        self._drain_aborts()

    def _drain_aborts(self) -> None:
        while True:
            try:
                kind, value = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self._report_aborted(dict.fromkeys(value, 0))

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_POLL) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, value = item
            if kind == "add":
                self._add(value)
            elif kind == "abort":
                self._abort(value)
            elif kind == "displace":
                tenant_id, decided = value
                decided.set_result(self._displace(tenant_id))
            elif kind == "lora_add":
                self._add_lora(*value)
            elif kind == "lora_sync":
                self.adapters.sync(value)
            elif kind == "shares":
                self.engine.set_tenant_shares(value.shares, value.priorities)
                self.tenant_shares = value
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, request: EngineRequest) -> None:
        if self._early_aborts.pop(request.request_id, None) is not None or request.request_id in self._active:
            # Aborted already, or a requeued copy of a request this engine still holds (its
            # heartbeat expired for a moment and another worker requeued it): the engine runs one.
            self._slots.release()
            return
        try:
            lora = None if request.lora_name is None else self.adapters.request_for(request.lora_name,
                                                                                   request.lora_path or "")
            self.engine.add_request(request.request_id, request.prompt_token_ids, request.params,
                                    arrival_time=request.arrival_time, priority=request.priority,
                                    cache_salt=request.cache_salt, tenant_id=request.tenant_id, lora_request=lora)
        except (InvalidRequestError, NotSupportedYetError) as error:
            self._slots.release()
            param = getattr(error, "param", None)
            if request.lora_name is not None and param in _ADAPTER_PARAMS:
                # a registered adapter that does not load (its folder moved, its files changed, a rank above this
                # worker's limit): the operator's to fix, not the client's; the reason without the folder
                logger.warning("LoRA adapter %r did not load for request %s: %s", request.lora_name,
                               request.request_id, error)
                reason = str(error).replace(request.lora_path, "its folder") if request.lora_path else str(error)
                self._on_rejected(request.request_id, 503, f"The LoRA adapter '{request.lora_name}' could not be "
                                  f"loaded by the worker: {reason}", None)
                return
            self._on_rejected(request.request_id, 400, str(error), param)
            return
        self._active.add(request.request_id)

    def _add_lora(self, name: str, path: str, done: concurrent.futures.Future) -> None:
        try:
            self.adapters.add(name, path)
        except Exception as error:  # noqa: BLE001 - the caller reports it (an InvalidRequestError names the limit)
            done.set_exception(error)
        else:
            done.set_result(None)

    def _displace(self, tenant_id: str | None) -> str | None:
        by_tenant: dict[str | None, list[str]] = {}
        for rid, tenant in self.engine.unstarted_requests():
            if rid in self._active:
                by_tenant.setdefault(tenant, []).append(rid)
        if by_tenant.get(tenant_id) or not by_tenant:
            return None
        victim = max(by_tenant, key=lambda t: len(by_tenant[t]))
        if len(by_tenant[victim]) < 2:
            return None
        rid = by_tenant[victim][-1]  # the latest: the one the scheduler would start last
        self.engine.abort_request([rid], report=False)
        self._active.discard(rid)  # its place goes to the caller
        return rid

    def _abort(self, request_ids: list[str]) -> None:
        now = time.monotonic()
        known = [rid for rid in request_ids if rid in self._active]
        for rid in request_ids:
            if rid not in self._active:
                self._early_aborts[rid] = now
        self._early_aborts = {r: t for r, t in self._early_aborts.items() if now - t < ABORT_MEMORY}
        computed = self.engine.abort_request(known) if known else {}
        for rid in known:
            self._active.discard(rid)
            self._slots.release()
        self._report_aborted({rid: computed.get(rid, 0) for rid in request_ids})

    def _finish(self, outputs: list) -> None:
        for out in outputs:
            if out.finished and out.request_id in self._active:
                self._active.discard(out.request_id)
                self._slots.release()

    def _abort_all(self) -> None:
        if self._active:
            try:
                self.engine.abort_request(list(self._active))
            except Exception:  # the engine may be the thing that failed
                logger.exception("abort on shutdown failed")
            for _ in self._active:
                self._slots.release()
            self._active.clear()
