"""Scheduling policies: the order of the waiting queue and of preemption, kept out of ``schedule()``.

A policy owns the waiting queue and orders the running list; the scheduler only asks it for the
next request to admit and preempts the last running request after :meth:`order_running`. A
tenant fair-share policy plugs in the same way: shares decide between tenants (its waiting order
and running order look at each tenant's use against its share), priority within a tenant.
"""
from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from ..errors import InvalidRequestError
from ..request import Request

POLICIES = ("fcfs", "priority")


class SchedulingPolicy(ABC):
    """The waiting queue and the preemption order of one scheduler."""

    name: str

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a newly arrived request."""

    @abstractmethod
    def requeue(self, request: Request) -> None:
        """Queue a preempted request (or a parallel sample forked without room to run)."""

    @abstractmethod
    def peek(self) -> Request:
        """The request to admit next. Raises IndexError when empty."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return :meth:`peek`."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Drop a queued request (finished or aborted while waiting). Raises ValueError if absent."""

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The queued requests, in no particular order."""

    @abstractmethod
    def __len__(self) -> int: ...

    def in_order(self) -> list[Request]:
        """The queued requests in the order they are admitted (``peek`` first)."""
        return list(self)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self)

    def order_running(self, running: list[Request]) -> None:
        """Reorder ``running`` in place: requests get the step's token budget in this order, and
        the last one is preempted first. The default keeps admission order (newest preempted)."""


class FcfsPolicy(SchedulingPolicy):
    """First come, first served: arrival order; a preempted request goes back to the front."""

    name = "fcfs"

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def requeue(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


def priority_key(request: Request) -> tuple[int, float]:
    """Lower priority value first; ties by arrival time (seconds)."""
    return request.priority, request.arrival_time


class PriorityPolicy(SchedulingPolicy):
    """Lowest ``priority`` value first, ties by arrival; preempts the running request with the
    highest value (the latest arrival among equals), as vLLM's ``priority`` policy does."""

    name = "priority"

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_key(request), next(self._tiebreak), request))

    requeue = add  # a preempted request keeps its place by (priority, arrival)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        index = next((i for i, entry in enumerate(self._heap) if entry[3] is request), None)
        if index is None:
            raise ValueError("request is not queued")
        self._heap[index] = self._heap[-1]
        self._heap.pop()
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in self._heap)

    def in_order(self) -> list[Request]:
        return [entry[3] for entry in sorted(self._heap, key=lambda entry: entry[:3])]

    def __len__(self) -> int:
        return len(self._heap)

    def order_running(self, running: list[Request]) -> None:
        running.sort(key=priority_key)  # stable, and nearly sorted already: about O(n)


def make_policy(name: str) -> SchedulingPolicy:
    """The policy called ``name`` (one of :data:`POLICIES`).

    Raises:
        InvalidRequestError: an unknown name (param ``scheduling_policy``).
    """
    if name == "fcfs":
        return FcfsPolicy()
    if name == "priority":
        return PriorityPolicy()
    raise InvalidRequestError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {name!r}.",
                              param="scheduling_policy")
