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
from .process_group import TensorParallelGroup


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


@dataclass(frozen=True)
class LinearPartition:
    """Where one rank's part of a linear layer lies in the full (unsplit, Hugging Face) layer.

    Quantized layers (``quantization.linear.QuantizedLinear``) read it to cut their packed checkpoint
    tensors the way the unquantized parallel layers cut ``weight``.

    Attributes:
        full_in_features, full_out_features: the unsplit layer's features (fused projections summed).
        in_range: ``[start, end)`` of the input features this rank holds (row-parallel: a slice;
            otherwise all of them).
        out_ranges: ``[start, end)`` rows of the full (fused) output this rank holds, in local order.
        shard_ranges: per fused HF projection (``"q_proj"``), this rank's ``[start, end)`` within it.
        reduce: the ranks' partial outputs are summed (row-parallel) before the bias is added.
        tp: the rank's group (its ``all_reduce``).
        full_shard_sizes: per fused HF projection, its full output features.
    """

    full_in_features: int
    full_out_features: int
    in_range: tuple[int, int]
    out_ranges: tuple[tuple[int, int], ...]
    shard_ranges: dict[str, tuple[int, int]]
    reduce: bool
    tp: TensorParallelGroup
    full_shard_sizes: dict[str, int]

    @property
    def splits_input(self) -> bool:
        return self.in_range != (0, self.full_in_features)


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


def _int4_split_problem(tp: int, hf_config, group_size: int) -> str | None:
    """Why ``tp`` ranks cannot split the model's 4-bit layers (None when they can): a row-parallel
    rank must hold whole quantization groups (and rows of 16, the kernel's smallest K block), a
    column-parallel rank whole int32 words of eight packed output features."""
    if tp == 1:
        return None  # nothing is split (the layer itself checks that its group size fits)
    num_heads, num_kv_heads = _heads_of(hf_config)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    inter = hf_config.intermediate_size
    row_unit = 16 if group_size == -1 else group_size
    for rank in range(tp):
        part = head_partition(num_heads, num_kv_heads, tp, rank)
        heads = (part.q_start * head_dim, (part.q_start + part.num_heads) * head_dim)
        kv = (part.kv_start * head_dim, (part.kv_start + part.num_kv_heads) * head_dim)
        mlp = split_range(inter, tp, rank)
        for layer, full, (start, end) in (("o_proj", num_heads * head_dim, heads), ("down_proj", inter, mlp)):
            if start % row_unit or end % row_unit:
                unit = (f"the group size {group_size} (each rank must hold whole quantization groups)"
                        if group_size != -1 else "16 (the 4-bit kernel's smallest block of input rows)")
                return (f"splits {layer}'s {full} input features into parts of {end - start} (rank {rank}: "
                        f"[{start}, {end})), not on multiples of {unit}")
        for layer, full, (start, end) in (("qkv_proj", num_heads * head_dim, heads),
                                          ("qkv_proj", num_kv_heads * head_dim, kv), ("gate_up_proj", inter, mlp)):
            if start % 8 or end % 8:
                return (f"splits {layer}'s {full} output features into parts of {end - start} (rank {rank}), "
                        "not on multiples of 8 (the 4-bit codes are packed eight to an int32)")
    return None


def valid_quantized_tensor_parallel_sizes(hf_config, method: str, group_size: int) -> list[int]:
    """The ``tensor_parallel_size`` values that both the attention heads and the quantized layers
    (``method`` ``awq``/``gptq`` with ``group_size``; FP8 adds no limit) allow, ascending."""
    sizes = valid_tensor_parallel_sizes(hf_config)
    if method not in ("awq", "gptq"):
        return sizes
    return [tp for tp in sizes if _int4_split_problem(tp, hf_config, group_size) is None]


def check_quantized_tensor_parallel_size(tp: int, hf_config, method: str, group_size: int) -> None:
    """Refuse a ``tensor_parallel_size`` (already valid for the heads) that cannot split the 4-bit
    layers of an AWQ/GPTQ model.

    Raises:
        InvalidRequestError (param ``tensor_parallel_size``): naming the layer, its features, the
            part a rank would hold and the group size, and listing the valid sizes, e.g.
            "tensor_parallel_size=9 splits down_proj's 1536 input features into parts of 170 ...;
            valid sizes with GPTQ group size 64: 1, 3." for SmolLM2.
    """
    if method not in ("awq", "gptq"):
        return
    problem = _int4_split_problem(tp, hf_config, group_size)
    if problem is not None:
        valid = ", ".join(str(v) for v in valid_quantized_tensor_parallel_sizes(hf_config, method, group_size))
        raise InvalidRequestError(f"tensor_parallel_size={tp} {problem}; valid sizes with {method.upper()} group "
                                  f"size {group_size}: {valid}.", param="tensor_parallel_size")
