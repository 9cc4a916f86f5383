"""What each request a worker took cost its tenant's virtual token counter, corrected when it ends.

The dequeue (:func:`.request_queue.take`) charges a tenant's shared counter with the tokens a
request *may* cost (its prompt plus ``n`` × ``max_tokens``). The worker's I/O thread counts
what the request really cost as its outputs go out (its prompt at the first output, then every
output token) and, when it ends (finished, failed or aborted), adds the difference to the
counter: a request that stopped early gives back what it did not use. The same counts feed
``served:<tenant>``, the tokens served per tenant that the dashboard charts.

Only the I/O thread calls :meth:`FairCharges.on_delta`, :meth:`~FairCharges.close` and
:meth:`~FairCharges.commands`; :meth:`~FairCharges.open` may run on another thread (a dict
assignment, atomic under the GIL).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .request_queue import fair_key


@dataclass
class _Charge:
    model: str
    tenant: str
    charge: float  # virtual tokens added to the counter at the dequeue
    cost: int  # tokens the dequeue assumed
    used: int = 0  # tokens counted so far
    started: bool = False


class FairCharges:
    """The open charges of one worker's requests, and the counter increments not written yet."""

    def __init__(self) -> None:
        self._open: dict[str, _Charge] = {}
        self._counters: dict[tuple[str, str], float] = defaultdict(float)
        self._served: dict[tuple[str, str], int] = defaultdict(int)

    def open(self, rid: str, model: str, tenant: str | None, charge: float, cost: int) -> None:
        """``rid`` was taken off ``model``'s queue with ``charge`` virtual tokens for ``cost`` tokens."""
        self._open[rid] = _Charge(model, tenant or "", charge, max(1, cost))

    def on_delta(self, rid: str, num_prompt_tokens: int, num_new_tokens: int) -> None:
        """One output of ``rid`` went out with ``num_new_tokens`` tokens (the prompt counts at the first)."""
        entry = self._open.get(rid)
        if entry is None:
            return
        tokens = num_new_tokens + (0 if entry.started else num_prompt_tokens)
        entry.started = True
        entry.used += tokens
        self._served[(entry.model, entry.tenant)] += tokens

    def close(self, rid: str) -> None:
        """``rid`` ended: correct its tenant's counter to what it used."""
        entry = self._open.pop(rid, None)
        if entry is not None:
            self._counters[(entry.model, entry.tenant)] += (entry.used - entry.cost) * entry.charge / entry.cost

    def drop(self, rid: str) -> None:
        """``rid`` went back to the queue (its charge was refunded there) or to another worker."""
        self._open.pop(rid, None)

    def commands(self) -> list[tuple[str, tuple, dict]]:
        """The Redis commands ``(method, args, kwargs)`` that write the increments gathered since
        the last call (for a pipeline); the increments are then forgotten."""
        commands: list[tuple[str, tuple, dict]] = []
        for (model, tenant), amount in self._counters.items():
            if amount:
                commands.append(("hincrbyfloat", (fair_key(model), f"c:{tenant}", amount), {}))
        for (model, tenant), tokens in self._served.items():
            commands.append(("hincrby", (fair_key(model), f"served:{tenant}", tokens), {}))
        self._counters.clear()
        self._served.clear()
        return commands
