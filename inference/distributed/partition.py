"""How a model is split over tensor-parallel ranks: which heads, rows and vocabulary entries a
rank holds, and which ``tensor_parallel_size`` values a model allows.

Megatron-LM's layout (Shoeybi et al., "Megatron-LM", 2019): attention heads and the MLP's
intermediate dimension are split across ranks (column-parallel in, row-parallel out), the
vocabulary is split for the embedding and the LM head. When a model has fewer KV heads than
ranks, each KV head is replicated: rank ``r`` holds KV head ``r * num_kv_heads // tp``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidRequestError


def split_range(size: int, tp: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s part of ``size`` items split as evenly as possible
    (the first ``size % tp`` ranks get one more). Used for the MLP's intermediate dimension,
    which need not divide (SmolLM2's 1536 over 9 ranks)."""
    return size * rank // tp, size * (rank + 1) // tp


@dataclass(frozen=True)
class HeadPartition:
    """The attention heads of one rank.

    Attributes:
        num_heads, num_kv_heads: query and KV heads this rank computes.
        q_start: its first query head (global index).
        kv_start: its first KV head (global index; replicated heads repeat across ranks).
    """

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def head_partition(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadPartition:
    """Rank ``rank``'s heads; ``tp`` must be valid (see :func:`check_tensor_parallel_size`)."""
    local_q = num_heads // tp
    if num_kv_heads >= tp:
        local_kv = num_kv_heads // tp
        return HeadPartition(local_q, local_kv, rank * local_q, rank * local_kv)
    return HeadPartition(local_q, 1, rank * local_q, rank * num_kv_heads // tp)


def _heads_of(hf_config) -> tuple[int, int]:
    num_heads = hf_config.num_attention_heads
    return num_heads, getattr(hf_config, "num_key_value_heads", None) or num_heads


def _is_valid(tp: int, num_heads: int, num_kv_heads: int) -> bool:
    if num_heads % tp:
        return False
    # KV heads split evenly, or each replicated over whole groups of ranks (so that every
    # rank's query heads share one KV head, as grouped-query attention requires).
    return num_kv_heads % tp == 0 if num_kv_heads >= tp else tp % num_kv_heads == 0


def valid_tensor_parallel_sizes(hf_config) -> list[int]:
    """Every ``tensor_parallel_size`` the model's attention heads allow, ascending."""
    num_heads, num_kv_heads = _heads_of(hf_config)
    return [tp for tp in range(1, num_heads + 1) if _is_valid(tp, num_heads, num_kv_heads)]


def check_tensor_parallel_size(tp: int, hf_config, model_name: str, device: str,
                               num_devices: int | None = None) -> None:
    """Refuse a ``tensor_parallel_size`` the model or the machine cannot run.

    Args:
        num_devices: visible GPUs (None: ``torch.cuda.device_count()`` when ``device`` is CUDA).
    Raises:
        InvalidRequestError (param ``tensor_parallel_size``): below 1; not a divisor of the attention
            heads, or a KV-head count that cannot be split or replicated evenly (the message lists the
            valid sizes, e.g. "valid sizes: 1, 3, 9" for SmolLM2's 9 heads); more ranks than visible GPUs.
    """
    if tp < 1:
        raise InvalidRequestError(f"tensor_parallel_size must be at least 1, got {tp}.", param="tensor_parallel_size")
    num_heads, num_kv_heads = _heads_of(hf_config)
    if not _is_valid(tp, num_heads, num_kv_heads):
        valid = ", ".join(str(v) for v in valid_tensor_parallel_sizes(hf_config))
        if num_heads % tp:
            reason = f"does not divide {model_name}'s {num_heads} attention heads"
        else:
            reason = (f"cannot split or replicate {model_name}'s {num_kv_heads} KV heads evenly "
                      f"({num_heads} attention heads)")
        raise InvalidRequestError(f"tensor_parallel_size={tp} {reason}; valid sizes: {valid}.",
                                  param="tensor_parallel_size")
    if tp > 1 and device.startswith("cuda"):
        if num_devices is None:
            import torch  # noqa: PLC0415
            num_devices = torch.cuda.device_count()
        if tp > num_devices:
            raise InvalidRequestError(f"tensor_parallel_size={tp} needs {tp} GPUs, but {num_devices} are visible "
                                      "(CUDA_VISIBLE_DEVICES).", param="tensor_parallel_size")
