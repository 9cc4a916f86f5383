"""The adapters loaded in host memory: an LRU cache of at most ``max_cpu_loras`` (vLLM's CPU LoRA cache)."""
from __future__ import annotations

import collections
import logging

import torch

from ..errors import InvalidRequestError
from .checkpoint import LoRAAdapter, load_adapter
from .config import LoRAConfig
from .request import LoRARequest

logger = logging.getLogger(__name__)


class LoRARegistry:
    """Loaded adapters by ``lora_int_id``, least recently used first.

    An adapter evicted here while requests still run with it stays in memory until they end (the
    requests hold it); the next request for it loads it again from its path.

    Args:
        config: the engine's LoRA limits.
        hf_config: the base model's config (adapters are checked against its shapes).
        dtype: the model's compute dtype (adapters' values must fit it).
    """

    def __init__(self, config: LoRAConfig, hf_config, dtype: torch.dtype | None = None) -> None:
        self.config = config
        self.hf_config = hf_config
        self.dtype = dtype
        self._adapters: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The loaded adapter of ``request``, loaded (and checked) first when absent; most recently used now.
        A load that would exceed ``max_cpu_loras`` evicts the least recently used adapter.

        Raises:
            InvalidRequestError: ``request`` is not a ``LoRARequest`` (``param="lora_request"``); its id is
                loaded under another name or path (``"lora_int_id"``); the adapter does not load or does not
                fit (see :func:`.checkpoint.load_adapter`). Nothing changes then.
        """
        if not isinstance(request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got {type(request).__name__}.",
                                      param="lora_request")
        adapter = self._adapters.get(request.lora_int_id)
        if adapter is not None:
            known = adapter.request
            if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
                raise InvalidRequestError(
                    f"lora_int_id {request.lora_int_id} is loaded as {known.lora_name!r} from {known.lora_path!r}, "
                    f"not {request.lora_name!r} from {request.lora_path!r}; remove it first (remove_lora).",
                    param="lora_int_id")
            self._adapters.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request, self.hf_config, self.config.max_lora_rank, self.dtype)
        while len(self._adapters) >= self.config.max_cpu_loras:
            evicted_id, evicted = self._adapters.popitem(last=False)
            logger.info("LoRA adapter %r (id %d) evicted from host memory (max_cpu_loras=%d)", evicted.lora_name,
                        evicted_id, self.config.max_cpu_loras)
        self._adapters[request.lora_int_id] = adapter
        logger.info("LoRA adapter %r (id %d, rank %d, %.1f MiB) loaded from %s", request.lora_name,
                    request.lora_int_id, adapter.rank, adapter.num_bytes / 2**20, request.lora_path)
        return adapter

    def add(self, request: LoRARequest) -> bool:
        """Load ``request``'s adapter; False when it was already loaded. Raises as :meth:`get`."""
        loaded = request.lora_int_id in self._adapters if isinstance(request, LoRARequest) else False
        self.get(request)
        return not loaded

    def remove(self, lora_int_id: int) -> bool:
        """Drop an adapter from host memory; False when it was not loaded."""
        return self._adapters.pop(lora_int_id, None) is not None

    def ids(self) -> set[int]:
        """The ids of the adapters loaded now."""
        return set(self._adapters)

    def requests(self) -> list[LoRARequest]:
        """The ``LoRARequest`` of every loaded adapter, least recently used first."""
        return [adapter.request for adapter in self._adapters.values()]
