"""One worker's requests from the moment it takes them off a queue until they end: the one owner
of what the worker knows of each (where its messages go and their sequence numbers, whether its
held record still stands, and what it cost its tenant's virtual token counter).

A request's life on a worker, as the ledger records it:

* **held**: taken, claimed and recorded as held (:func:`.request_queue.take`), waiting in the
  engine's backlog; its first message (an output or an error) settles the held record
  (:func:`.held.settle`), or another worker took it over (it is then *lost* here);
* **running**: its first message went out; its messages go to its reply channel, numbered;
* it **ends**: finished, failed, or its client left (an abort). Its charge is then corrected to
  the tokens it really cost, and nothing more of it is published. For an abort the correction waits
  for the engine to drop the request (:meth:`RequestLedger.aborted`): a prompt whose prefill had begun
  counts, answered or not, so that a tenant cannot take prefills for free by leaving before the first
  token. A request given back to the
  queue (displaced, or the worker stops taking) or lost to another worker leaves without a
  correction: the give-back refunded its charge, the other worker charged its own.

Charges: the dequeue charges a tenant's shared counter with what a request *may* cost (its prompt
plus ``n`` × ``max_tokens``); the ledger counts what it cost as its messages go out (its prompt at
the first output, then every output token) and, at its end, adds the difference, so that a
request that stopped early gives back what it did not use. The same counts feed
``served:<tenant>`` of the model's fair hash (:func:`webapp.transport.keys.fair_key`), which the
dashboard's share chart reads.

Threads: the dispatcher calls :meth:`RequestLedger.open`; everything else runs on the worker's
I/O thread. An entry is added whole, in one dict assignment (atomic under the GIL).
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass

from webapp.transport.keys import claim_key, counter_field, fair_key, held_key, served_field
from webapp.transport.wire import QueuedRequest


@dataclass
class Entry:
    """What the worker knows of one request it took (see the module docstring)."""

    request: QueuedRequest
    payload: str  # the request as queued (to requeue it, or to restore its records after Redis lost them)
    model: str
    reply: str | None  # its reply channel; None once it ended (nothing more is published)
    held: bool  # its held record stands (not started yet)
    tenant: str  # '' for no tenant
    charge: float  # virtual tokens the dequeue added to its tenant's counter
    cost: int  # tokens the dequeue assumed it would cost
    seq: int = 0  # number of the next message to its client
    used: int = 0  # tokens counted so far
    started: bool = False  # its prompt was counted (first output)
    left: bool = False  # its client left; the engine's count of its computed prompt is awaited (aborted)
    report_to: str | None = None  # where that count goes (its reply channel, once its client left)


class RequestLedger:
    """The requests one worker took and has not forgotten yet, and the counter increments to write."""

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._counters: dict[tuple[str, str], float] = defaultdict(float)
        self._served: dict[tuple[str, str], int] = defaultdict(int)

    def __contains__(self, rid: str) -> bool:
        return rid in self._entries

    def open(self, request: QueuedRequest, charge: float, payload: str | None = None) -> None:
        """``request`` was taken off its queue (held, claimed) with ``charge`` virtual tokens;
        ``payload``: its message as queued (None: ``request.encode()``)."""
        self._entries[request.rid] = Entry(request, payload or request.encode(), request.model, request.reply, True,
                                           request.tenant or "", charge, request.cost)

    def get(self, rid: str) -> Entry | None:
        return self._entries.get(rid)

    def restore_commands(self, worker_id: str, claim_ttl: int) -> list[tuple[str, tuple, dict]]:
        """Redis commands that write again, where missing, the claims of this worker's requests and
        the held records of those not started (after Redis lost its data), for a pipeline."""
        commands: list[tuple[str, tuple, dict]] = []
        for rid, entry in list(self._entries.items()):  # the dispatcher may add one meanwhile
            if entry.reply is None:
                continue
            commands.append(("set", (claim_key(rid), worker_id), {"nx": True, "ex": claim_ttl}))
            if entry.held:
                record = json.dumps({"worker": worker_id, "payload": entry.payload, "charge": entry.charge})
                commands.append(("hsetnx", (held_key(entry.model), rid, record), {}))
        return commands

    def held(self, rids) -> dict[str, str]:
        """Request id -> model, of those of ``rids`` whose held record still stands."""
        return {rid: e.model for rid in rids if (e := self._entries.get(rid)) is not None and e.held}

    def settled(self, rid: str) -> None:
        """Its held record is gone: it started here (or its client aborted it before)."""
        entry = self._entries.get(rid)
        if entry is not None:
            entry.held = False
            if entry.reply is None and not entry.left:
                del self._entries[rid]

    def leave(self, rid: str) -> None:
        """It left this worker without ending: given back to the queue, or taken over by another worker."""
        self._entries.pop(rid, None)

    def on_output(self, rid: str, num_prompt_tokens: int, num_new_tokens: int) -> None:
        """An output of ``rid`` with ``num_new_tokens`` tokens goes out (its prompt counts at the first)."""
        entry = self._entries.get(rid)
        if entry is None or entry.reply is None:
            return
        tokens = num_new_tokens + (0 if entry.started else num_prompt_tokens)
        entry.started = True
        entry.used += tokens
        self._served[(entry.model, entry.tenant)] += tokens

    def next_message(self, rid: str) -> tuple[str, int] | None:
        """``(reply channel, seq)`` of the next message of ``rid`` to publish, or None when nothing
        more of it goes out (its client left, it ended, or it is not this worker's)."""
        entry = self._entries.get(rid)
        if entry is None or entry.reply is None:
            return None
        entry.seq += 1
        return entry.reply, entry.seq - 1

    def end(self, rid: str) -> None:
        """``rid`` ended (finished or failed): correct its tenant's counter to what it used, and publish
        nothing more of it."""
        entry = self._entries.get(rid)
        if entry is None or entry.reply is None:
            return
        entry.reply = None
        self._correct(rid, entry)

    def client_left(self, rid: str) -> bool:
        """The client of ``rid`` left (an abort): publish nothing more of it; its charge is corrected by
        :meth:`aborted` once the engine dropped it. Returns whether :meth:`aborted` will name where to report
        the engine's count (False: the worker does not have ``rid``, or it ended)."""
        entry = self._entries.get(rid)
        if entry is not None and entry.reply is not None:
            entry.reply, entry.left, entry.report_to = None, True, entry.reply
        return entry is not None and entry.left

    def aborted(self, rid: str, computed_prompt_tokens: int) -> str | None:
        """The engine dropped ``rid`` after its client left, having computed ``computed_prompt_tokens`` of its
        prompt (prefix-cache hits included; 0 where its prefill had not begun or the engine never had it):
        correct its tenant's counter to what it used, its prompt counted where its prefill had begun, as it
        is for a request that answered (an output's prompt counts whole). Returns the reply channel to send
        the count to (:func:`.messages.aborted_message`), None for a request whose client did not leave."""
        entry = self._entries.get(rid)
        if entry is None or not entry.left:
            return None
        entry.left = False
        if not entry.started and computed_prompt_tokens > 0:
            entry.started = True
            entry.used += computed_prompt_tokens
            self._served[(entry.model, entry.tenant)] += computed_prompt_tokens
        self._correct(rid, entry)
        return entry.report_to

    def _correct(self, rid: str, entry: Entry) -> None:
        self._counters[(entry.model, entry.tenant)] += (entry.used - entry.cost) * entry.charge / max(1, entry.cost)
        if not entry.held:
            del self._entries[rid]

    def counter_commands(self) -> list[tuple[str, tuple, dict]]:
        """The Redis commands ``(method, args, kwargs)`` that write the counter increments gathered
        since the last call (for a pipeline); they are then forgotten here."""
        commands: list[tuple[str, tuple, dict]] = []
        for (model, tenant), amount in self._counters.items():
            if amount:
                commands.append(("hincrbyfloat", (fair_key(model), counter_field(tenant), amount), {}))
        for (model, tenant), tokens in self._served.items():
            commands.append(("hincrby", (fair_key(model), served_field(tenant), tokens), {}))
        self._counters.clear()
        self._served.clear()
        return commands
