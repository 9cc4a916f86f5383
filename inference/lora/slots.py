"""Which adapter each device slot holds, and how many adapters one step may use.

Host logic only, in adapter keys and slot numbers (the model runner owns the slot tensors): the
scheduler admits a waiting request only while the step's running requests use fewer than
``max_loras`` distinct adapters, or the request's adapter is among them (others behind it are still
admitted); then :meth:`LoRASlots.assign` gives each adapter of the step a slot, keeping adapters
where they are and replacing the least recently used slot otherwise (vLLM's LRU of active adapters).
"""
from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .checkpoint import LoRAAdapter

if TYPE_CHECKING:
    from ..request import Request


class LoRASlots:
    """``max_loras`` device slots, least recently used first."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: collections.OrderedDict[str, int] = collections.OrderedDict()  # adapter key -> slot

    @staticmethod
    def active_keys(running: Iterable[Request]) -> set[str]:
        """The adapter keys of ``running`` (requests without an adapter use none)."""
        return {r.lora_adapter.key for r in running if r.lora_adapter is not None}

    def admits(self, request: Request, active: set[str]) -> bool:
        """Whether ``request`` may join a step whose requests use the adapters ``active``."""
        adapter = request.lora_adapter
        return adapter is None or adapter.key in active or len(active) < self.max_loras

    def assign(self, requests: Iterable[Request]) -> tuple[dict[str, int], list[tuple[int, LoRAAdapter]]]:
        """Slots for the adapters of one step's requests.

        Returns:
            ``(slot of each adapter key, loads)``: the ``(slot, adapter)`` pairs the runner must copy into
            its slot tensors before the step.
        Raises:
            RuntimeError: the requests use more than ``max_loras`` adapters (the scheduler prevents it).
        """
        adapters: dict[str, LoRAAdapter] = {}
        for request in requests:
            if request.lora_adapter is not None:
                adapters.setdefault(request.lora_adapter.key, request.lora_adapter)
        if len(adapters) > self.max_loras:
            raise RuntimeError(f"a step uses {len(adapters)} LoRA adapters, more than max_loras={self.max_loras}")
        slot_of: dict[str, int] = {}
        for key in adapters:
            if key in self._slot_of:
                self._slot_of.move_to_end(key)
                slot_of[key] = self._slot_of[key]
        loads = []
        free = sorted(set(range(self.max_loras)) - set(self._slot_of.values()))
        for key, adapter in adapters.items():
            if key in slot_of:
                continue
            if free:
                slot = free.pop(0)
            else:  # the least recently used slot that this step does not use
                victim = next(k for k in self._slot_of if k not in slot_of)
                slot = self._slot_of.pop(victim)
            self._slot_of[key] = slot_of[key] = slot
            loads.append((slot, adapter))
        return slot_of, loads

    def resident(self) -> dict[str, int]:
        """Adapter key -> slot of every slot holding an adapter, least recently used first."""
        return dict(self._slot_of)
