"""LoRA serving limits, and the parsing of ``--lora-modules`` values."""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import InvalidRequestError
from .request import LoRARequest

MAX_LORA_RANK_LIMIT = 512  # the largest --max-lora-rank accepted (vLLM's largest supported rank)


@dataclass(frozen=True)
class LoRAConfig:
    """How many adapters the engine serves at once and how large they may be.

    Attributes:
        max_loras: adapters in one batch (device slots, each ``max_lora_rank`` wide).
        max_lora_rank: the largest adapter rank accepted; every slot is padded to it.
        max_cpu_loras: adapters kept loaded in host memory (an LRU cache, at least ``max_loras``).
        modules: the adapters given at start (``--lora-modules``), ids 1, 2, ... in order.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    modules: tuple[LoRARequest, ...] = ()


def parse_lora_module(value, lora_int_id: int) -> LoRARequest:
    """One ``--lora-modules`` value as a ``LoRARequest`` with id ``lora_int_id``.

    Accepts ``"name=path"``, the JSON form ``'{"name": ..., "path": ..., "base_model_name": ...}'``
    (vLLM's), the same as a dict, or a ``LoRARequest`` (its id is replaced).

    Raises:
        InvalidRequestError: a value in none of these forms (``param="lora_modules"``).
    """
    if isinstance(value, LoRARequest):
        return LoRARequest(value.lora_name, lora_int_id, value.lora_path, value.base_model_name)
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise InvalidRequestError(f"lora_modules: {value!r} is not valid JSON ({error}).",
                                      param="lora_modules") from None
    if isinstance(value, dict):
        unknown = set(value) - {"name", "path", "base_model_name"}
        if unknown or not isinstance(value.get("name"), str) or not isinstance(value.get("path"), str):
            raise InvalidRequestError("lora_modules: a JSON module needs string 'name' and 'path' (and may have "
                                      f"'base_model_name'); got {value!r}.", param="lora_modules")
        return LoRARequest(value["name"], lora_int_id, value["path"], value.get("base_model_name"))
    if isinstance(value, str) and "=" in value:
        name, _, path = value.partition("=")
        if name and path:
            return LoRARequest(name, lora_int_id, path)
    raise InvalidRequestError(f"lora_modules: expected 'name=path' or a JSON object with 'name' and 'path', got "
                              f"{value!r}.", param="lora_modules")


def parse_lora_modules(values) -> tuple[LoRARequest, ...]:
    """All ``--lora-modules`` values, ids 1, 2, ... in order.

    Raises:
        InvalidRequestError: a malformed value or two modules of one name (``param="lora_modules"``).
    """
    modules = tuple(parse_lora_module(value, index) for index, value in enumerate(values or (), 1))
    names = [m.lora_name for m in modules]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidRequestError(f"lora_modules: the name {duplicates[0]!r} is given twice.", param="lora_modules")
    return modules
