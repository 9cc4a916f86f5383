"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter, named by the caller, to apply to a request.

    ``LoRARequest(lora_name, lora_int_id, lora_path)`` as in vLLM.

    Attributes:
        lora_name: the adapter's name (what an OpenAI client sends as ``model``).
        lora_int_id: the adapter's id, unique per engine, at least 1 (0 means "no adapter").
        lora_path: a folder with a PEFT checkpoint (``adapter_config.json`` and
            ``adapter_model.safetensors``).
        base_model_name: the model the adapter was trained on, informational (vLLM's ``base_model_name``).
    Raises:
        InvalidRequestError: an id below 1 (``param="lora_int_id"``), an empty name (``"lora_name"``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise InvalidRequestError(f"lora_int_id must be an integer of at least 1, got {self.lora_int_id!r}.",
                                      param="lora_int_id")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError(f"lora_name must be a non-empty string, got {self.lora_name!r}.",
                                      param="lora_name")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
