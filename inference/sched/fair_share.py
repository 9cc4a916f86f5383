"""Tenant GPU shares in the scheduler: weighted fair queuing over tokens.

The Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language Models"
(OSDI 2024), with weights. Every tenant has a counter of the tokens the engine computed for
it (prefill and decode tokens alike, as they count against the step's token budget),
divided by its share. Then:

* **Admission** (:meth:`FairShare.order_waiting`): among the tenants with waiting
  requests, the one with the lowest counter, i.e. the furthest below its share, goes first.
  The order is built as a merge on *tentative* counters: after each request taken, its
  tenant's counter grows by the tokens that request may still compute (its uncomputed
  prompt plus its remaining ``max_tokens``: admitting a request commits to its decode too),
  so slots freed in one step are split between the backlogged tenants in the ratio of their
  shares rather than going all to one of them. Within a tenant: lower ``priority`` first,
  then arrival order.
* **Work conservation**: the order only ranks requests, it never holds one back; a tenant
  alone gets the whole budget.
* **No burst credit**: a tenant that becomes active (its first request, or the first after
  being idle) has its counter lifted to the lowest counter among the tenants already
  active (the system's virtual time when none is): idle time earns nothing. The virtual
  time follows the active tenants at every step, also while nothing waits (the scheduler
  observes its running requests then), so a tenant served alone, because the others were
  idle, owes nothing for it when they return.
* **Running requests** (:meth:`FairShare.order_running`) are ranked by how much KV cache
  their tenant holds per unit of share, least first, so that the step's budget goes first
  to the tenants below their share, and the tenants above it come last.
* **Preemption** (:meth:`FairShare.pick_victim`): when KV blocks run out, the victim comes
  from the tenant holding the most KV relative to its share (then the highest counter,
  then the larger tenant priority number); within that tenant, the largest ``priority``
  number, then the most recently admitted. The scheduler only preempts requests it has not
  scheduled yet in the step; ordering the running requests as above keeps the tenants
  above their share among those.

Shares arrive as plain numbers (percentages; only their ratios matter). A share of 0 or an
unknown tenant counts as ``MIN_SHARE``, so it is never starved while others have work.
Counters are relative: only differences between active tenants matter.

Requests are duck-typed: anything with ``tenant_id``, ``priority``, ``arrival_time``,
``num_tokens``, ``num_computed_tokens``, ``max_tokens`` and ``num_output_tokens``
(``inference.request.Request``).
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Hashable, Protocol

MIN_SHARE = 1.0  # percent: the weight of a tenant without a share


class TenantRequest(Protocol):
    tenant_id: Hashable
    priority: int
    arrival_time: float
    num_computed_tokens: int
    max_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...


class FairShare:
    """Virtual token counters of the tenants, and the orders they imply.

    Args:
        shares: tenant id -> share (percent, ``>= 0``); others get ``MIN_SHARE``.
        priorities: tenant id -> priority; lower goes first between tenants whose counters
            are equal (e.g. two tenants arriving on an idle engine). Default 0.

    Raises:
        ValueError: a share is negative or not finite.
    """

    def __init__(self, shares: Mapping[Hashable, float] | None = None,
                 priorities: Mapping[Hashable, int] | None = None) -> None:
        self.shares: dict[Hashable, float] = {}
        self.priorities: dict[Hashable, int] = {}
        self.counters: dict[Hashable, float] = {}  # tenant -> served tokens / weight (virtual tokens)
        self.served_tokens: dict[Hashable, int] = {}  # tenant -> tokens computed for it (all time)
        self.virtual_time = 0.0  # lowest counter among the active tenants; never decreases
        self._active: set[Hashable] = set()
        self.set_shares(shares or {}, priorities)

    # ---- configuration -----------------------------------------------------------------
    def set_shares(self, shares: Mapping[Hashable, float], priorities: Mapping[Hashable, int] | None = None) -> None:
        """Replace the shares (and priorities); counters are kept, so a change applies from now on."""
        for tenant, share in shares.items():
            if not (share >= 0 and share != float("inf")):
                raise ValueError(f"share of tenant {tenant!r} must be a finite number >= 0, got {share!r}")
        self.shares = {t: float(s) for t, s in shares.items()}
        self.priorities = dict(priorities or {})

    def weight(self, tenant: Hashable) -> float:
        """The tenant's weight: its share in percent, at least ``MIN_SHARE``."""
        return max(self.shares.get(tenant, 0.0), MIN_SHARE)

    # ---- accounting ----------------------------------------------------------------------
    def charge(self, tenant: Hashable, tokens: int) -> None:
        """The engine computed ``tokens`` tokens (prefill or decode) for ``tenant`` in a step."""
        if tokens <= 0:
            return
        self.counters[tenant] = self.counters.get(tenant, self.virtual_time) + tokens / self.weight(tenant)
        self.served_tokens[tenant] = self.served_tokens.get(tenant, 0) + tokens

    def observe(self, waiting: Iterable[TenantRequest], running: Iterable[TenantRequest]) -> None:
        """Note which tenants have work now; newly active ones are lifted to the virtual time."""
        active = {r.tenant_id for r in waiting} | {r.tenant_id for r in running}
        stayed = active & self._active
        if stayed:
            self.virtual_time = max(self.virtual_time, min(self.counters.get(t, 0.0) for t in stayed))
        for tenant in active - self._active:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), self.virtual_time)
        if active:
            self.virtual_time = max(self.virtual_time, min(self.counters[t] for t in active))
        self._active = active

    # ---- decisions -----------------------------------------------------------------------
    def order_waiting(self, waiting: Sequence[TenantRequest], running: Iterable[TenantRequest] = (),
                      limit: int | None = None) -> list[TenantRequest]:
        """The waiting requests in the order to admit them (see the module docstring).

        Args:
            waiting: the waiting queue, in its current order (ties keep it).
            running: the running requests (to know which tenants are active).
            limit: order only the first ``limit`` places (at most that many can be admitted
                in one step); the rest follow in their current order.
        Returns:
            A new list with the same requests.
        """
        self.observe(waiting, running)
        by_tenant: dict[Hashable, list[TenantRequest]] = {}
        for request in waiting:
            by_tenant.setdefault(request.tenant_id, []).append(request)
        if len(by_tenant) <= 1:
            return list(waiting)
        limit = len(waiting) if limit is None else min(limit, len(waiting))
        queues = {}
        for tenant, requests in by_tenant.items():
            ranked = sorted(range(len(requests)), key=lambda i: (requests[i].priority, requests[i].arrival_time, i))
            queues[tenant] = iter([requests[i] for i in ranked[:limit]])
        tiebreak = itertools.count()
        heap = [(self.counters.get(t, self.virtual_time), self.priorities.get(t, 0), next(tiebreak), t)
                for t in queues]
        heapq.heapify(heap)
        ordered: list[TenantRequest] = []
        taken: set[int] = set()
        while heap and len(ordered) < limit:
            counter, priority, _, tenant = heapq.heappop(heap)
            request = next(queues[tenant], None)
            if request is None:
                continue
            ordered.append(request)
            taken.add(id(request))
            cost = max(1, request.num_tokens - request.num_computed_tokens
                       + request.max_tokens - request.num_output_tokens)
            heapq.heappush(heap, (counter + cost / self.weight(tenant), priority, next(tiebreak), tenant))
        ordered.extend(r for r in waiting if id(r) not in taken)
        return ordered

    def _excess(self, running: Sequence[TenantRequest]) -> dict[Hashable, tuple[float, float, int]]:
        """Tenant -> sort key of how far above its share it is (KV held per share, counter, priority)."""
        held: dict[Hashable, int] = {}
        for request in running:
            held[request.tenant_id] = held.get(request.tenant_id, 0) + request.num_computed_tokens + 1
        return {t: (n / self.weight(t), self.counters.get(t, 0.0), self.priorities.get(t, 0)) for t, n in held.items()}

    def order_running(self, running: Sequence[TenantRequest]) -> list[TenantRequest]:
        """The running requests, tenants furthest below their share first (stable within a tenant,
        so a single tenant's order is unchanged). Returns a new list."""
        if len({r.tenant_id for r in running}) <= 1:
            return list(running)
        excess = self._excess(running)
        return sorted(running, key=lambda r: excess[r.tenant_id])

    def pick_victim(self, running: Sequence[TenantRequest], start: int = 0) -> Any:
        """The request to preempt among ``running[start:]`` (``running`` in admission order).

        The tenant holding the most KV (computed tokens of all its running requests) per
        unit of share loses first; ties go to the higher counter, then the larger tenant
        priority number. Within that tenant: the largest ``priority`` number, then the
        most recently admitted. With one tenant this is the most recently admitted request,
        the engine's plain policy.

        Raises:
            ValueError: ``running[start:]`` is empty.
        """
        candidates = list(range(start, len(running)))
        if not candidates:
            raise ValueError("no running request to preempt")
        excess = self._excess(running)
        victim_tenant = max({running[i].tenant_id for i in candidates}, key=excess.__getitem__)
        index = max((i for i in candidates if running[i].tenant_id == victim_tenant),
                    key=lambda i: (running[i].priority, i))
        return running[index]
