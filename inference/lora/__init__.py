"""LoRA adapter serving: many PEFT adapters over one base model, batched together in each step.

``request`` (``LoRARequest``), ``config`` (limits, ``--lora-modules``), ``checkpoint`` (PEFT loading and
checks), ``registry`` (the host LRU of loaded adapters), ``slots`` (device slots, the per-step
adapter limit), ``layers`` (the wrapped projections), ``torch_ref`` / ``triton_lora`` (the batched
matmuls). See docs/lora.md.
"""
from .request import LoRARequest

__all__ = ["LoRARequest"]
