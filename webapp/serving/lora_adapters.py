"""The LoRA adapters of one worker's engine, by the name clients send as ``model``: :class:`EngineAdapters`.

An adapter reaches a worker in two ways. The adapters of ``--lora-modules`` are loaded by the engine
at start (ids 1, 2, ... in order, :mod:`inference.lora.config`). The adapters registered at run time
(``POST /v1/load_lora_adapter``, the admin, ``manage.py lora_adapter``) are in Redis
(:func:`webapp.transport.keys.LORA_ADAPTERS_KEY`): the worker reads them with every heartbeat and
loads the new ones of its model (:meth:`EngineAdapters.sync`), and each queued request names its
adapter and path too, so a worker that has not read the registry yet still serves it. Ids are this
engine's own (vLLM's ``lora_int_id`` is per engine): a runtime adapter gets the next unused one.

Used only on the engine-loop thread (the engine's only thread), so it needs no lock.
"""
from __future__ import annotations

import logging
from typing import Any

from inference import LoRARequest
from inference.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class EngineAdapters:
    """The adapters an engine knows, by name, with the ``LoRARequest`` each runs as.

    Args:
        engine: an ``inference.LLMEngine`` (its ``config.lora`` None when LoRA is off).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        lora = engine.config.lora
        self.enabled = lora is not None
        self.max_lora_rank = lora.max_lora_rank if lora is not None else 0
        self.max_loras = lora.max_loras if lora is not None else 0
        self.startup: dict[str, LoRARequest] = {m.lora_name: m for m in (lora.modules if lora else ())}
        self._by_name: dict[str, LoRARequest] = dict(self.startup)
        self._next_id = max((m.lora_int_id for m in self.startup.values()), default=0) + 1
        self.loaded: tuple[str, ...] = tuple(sorted(self.startup))  # replaced whole: other threads read it

    def request_for(self, name: str, path: str) -> LoRARequest:
        """The ``LoRARequest`` a request for adapter ``name`` at ``path`` runs with; a new id when the
        name is new here or was registered again with another path (the old one is unloaded).

        Raises:
            InvalidRequestError: LoRA is off in this engine (``param="model"``).
        """
        if not self.enabled:
            raise InvalidRequestError(f"The model '{name}' is a LoRA adapter, and this worker's engine serves no "
                                      "adapters (start it with --enable-lora).", param="model")
        known = self._by_name.get(name)
        if known is not None and known.lora_path == path:
            return known
        if known is not None:
            self.engine.remove_lora(known.lora_int_id)
        request = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        self._by_name[name] = request
        self.loaded = tuple(sorted(self._by_name))
        return request

    def add(self, name: str, path: str) -> None:
        """Load adapter ``name`` from ``path`` now, checked against the model and the engine's limits.

        Raises:
            InvalidRequestError: LoRA is off, or the adapter does not load or fit (``param`` names the
                field or limit: ``lora_path``, ``max_lora_rank``, ``target_modules``); nothing is kept then.
        """
        known = self._by_name.get(name)
        request = self.request_for(name, path)
        try:
            self.engine.add_lora(request)
        except Exception:
            if known is None or known.lora_path != path:  # forget the id the refused adapter got
                self._by_name.pop(name, None)
            raise
        self.loaded = tuple(sorted(self._by_name))

    def remove(self, name: str) -> bool:
        """Unload a runtime adapter (requests already queued with it still run); False when unknown here.
        The start-up adapters of ``--lora-modules`` stay."""
        if name in self.startup:
            return False
        request = self._by_name.pop(name, None)
        self.loaded = tuple(sorted(self._by_name))
        return request is not None and self.engine.remove_lora(request.lora_int_id)

    def sync(self, registered: dict[str, str]) -> None:
        """Follow the registry of this model's runtime adapters (name -> path): load the new ones and unload
        those no longer registered. A failed load is logged; requests for it get the error then."""
        if not self.enabled:
            return
        for name in [n for n in self._by_name if n not in self.startup and n not in registered]:
            self.remove(name)
            logger.info("LoRA adapter %s unloaded (no longer registered)", name)
        for name, path in registered.items():
            known = self._by_name.get(name)
            if name in self.startup or (known is not None and known.lora_path == path):
                continue
            try:
                self.add(name, path)
            except InvalidRequestError as error:
                logger.warning("LoRA adapter %s from %s not loaded: %s", name, path, error)

