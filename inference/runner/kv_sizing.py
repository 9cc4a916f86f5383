"""How many KV blocks fit: kv_cache_space on CPU; on GPU, what gpu_memory_utilization leaves after
the weights and a profiled activation peak."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..attention import AttentionMetadata, PrefillSegment
from ..attention.kv_quant import kv_cache_torch_dtype
from ..config import EngineConfig
from ..errors import InvalidRequestError

GiB = 1 << 30


def bytes_per_block(config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one KV block over all layers: ``2 * layers * block_size * Hk * D * element size`` (of the
    cache's dtype: one byte with an FP8 cache)."""
    element = torch.tensor([], dtype=kv_cache_torch_dtype(config.cache.cache_dtype, config.dtype)).element_size()
    return 2 * num_layers * config.cache.block_size * num_kv_heads * head_dim * element


@torch.inference_mode()
def profile_activation_peak(model, config: EngineConfig, num_kv_heads: int, head_dim: int) -> int:
    """Peak GPU bytes of the largest step beyond the weights: one forward of ``max_num_batched_tokens``
    tokens (one prefill, reference attention over a scratch cache) and the logits of ``max_num_seqs`` rows."""
    device = config.device
    tokens = min(config.scheduler.max_num_batched_tokens, config.max_model_len)
    block_size = config.cache.block_size
    num_blocks = -(-tokens // block_size)
    scratch = [torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=config.dtype, device=device)
               for _ in range(config.hf_config.num_hidden_layers)]
    scratch_bytes = sum(t.numel() * t.element_size() for t in scratch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    meta = AttentionMetadata(
        slot_mapping=torch.arange(tokens, device=device), decode_indices=torch.empty(0, dtype=torch.long, device=device),
        decode_block_tables=torch.empty(0, 0, dtype=torch.long, device=device),
        decode_seq_lens=torch.empty(0, dtype=torch.long, device=device),
        prefills=[PrefillSegment(0, tokens, 0, torch.arange(num_blocks, device=device))], block_size=block_size)
    hidden = model(torch.zeros(tokens, dtype=torch.long, device=device), torch.arange(tokens, device=device),
                   scratch, meta)
    rows = min(config.scheduler.max_num_seqs, tokens)
    logits = model.compute_logits(hidden[:rows])
    if logits is not None:  # None on tensor-parallel ranks other than 0 (rank 0 gathers the logits)
        torch.log_softmax(logits.float(), dim=-1).sort(dim=-1)  # the sampler's float32 working set
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del scratch, hidden, logits
    torch.cuda.empty_cache()
    return max(peak - scratch_bytes, 0)


def num_swap_blocks(config: EngineConfig, block_bytes: int) -> int:
    """Blocks of the CPU swap space: ``swap_space`` GiB over the bytes of one block.

    Raises:
        InvalidRequestError: ``swap_space`` holds less than one block (param ``swap_space``).
    """
    blocks = int(config.cache.swap_space * GiB // block_bytes)
    if blocks < 1:
        raise InvalidRequestError(f"swap_space={config.cache.swap_space} GiB holds no KV block of "
                                  f"{block_bytes} bytes.", param="swap_space")
    return blocks


def num_kv_blocks(config: EngineConfig, model, weights_bytes: int, block_bytes: int, num_kv_heads: int,
                  head_dim: int) -> int:
    """The KV pool size in blocks.

    Raises:
        InvalidRequestError: the pool cannot hold one sequence of ``max_model_len``, with the numbers
            and the remedies.
    """
    cache = config.cache
    if config.device == "cpu":
        budget = cache.kv_cache_space * GiB
        where = f"kv_cache_space={cache.kv_cache_space} GiB"
    else:
        try:
            activation = profile_activation_peak(model, config, num_kv_heads, head_dim)
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            raise InvalidRequestError(
                f"A forward pass of max_num_batched_tokens={config.scheduler.max_num_batched_tokens} tokens ran out "
                f"of GPU memory after the weights ({weights_bytes / GiB:.2f} GiB) were loaded. Remedies: lower "
                "max_num_batched_tokens or max_num_seqs, quantize the model, add tensor parallelism, or free "
                "the GPU.", param="max_num_batched_tokens") from exc
        free, total = torch.cuda.mem_get_info()
        others = total - free - torch.cuda.memory_allocated()
        budget = total * cache.gpu_memory_utilization - others - torch.cuda.memory_allocated() - activation
        where = (f"gpu_memory_utilization={cache.gpu_memory_utilization} of {total / GiB:.1f} GiB, weights "
                 f"{weights_bytes / GiB:.2f} GiB, activation peak {activation / GiB:.2f} GiB, "
                 f"other processes {others / GiB:.2f} GiB")
    blocks = int(budget // block_bytes)
    max_len = config.max_model_len
    if blocks * cache.block_size < max_len:
        raise InvalidRequestError(
            f"The KV cache has room for {max(blocks, 0) * cache.block_size} tokens ({max(budget, 0) / GiB:.2f} GiB "
            f"from {where}), fewer than one sequence of max_model_len={max_len}. Remedies: raise "
            "gpu_memory_utilization (GPU) or kv_cache_space (CPU), lower max_model_len or max_num_seqs or "
            "max_num_batched_tokens, enable chunked prefill, quantize the model or add tensor parallelism.",
            param="max_model_len")
    return blocks


def check_weights_fit(weights_bytes: int, free_bytes: int, total_bytes: int, gpu_memory_utilization: float) -> None:
    """Refuse a model whose weights exceed the device memory the engine may use.

    Args:
        weights_bytes: parameters and buffers of the model (bytes).
        free_bytes, total_bytes: the device's free and total memory now (``torch.cuda.mem_get_info``).
    Raises:
        InvalidRequestError: the weights do not fit, with the numbers and the remedies.
    """
    used_by_others = total_bytes - free_bytes
    budget = total_bytes * gpu_memory_utilization - used_by_others
    if weights_bytes <= budget:
        return
    raise InvalidRequestError(
        f"The model weights need {weights_bytes / GiB:.2f} GiB but only {max(budget, 0) / GiB:.2f} GiB may be used "
        f"(gpu_memory_utilization={gpu_memory_utilization} of {total_bytes / GiB:.1f} GiB, "
        f"{used_by_others / GiB:.2f} GiB already in use by other processes), and the KV cache needs room "
        "beyond that. Remedies: quantize the model (--quantization awq|gptq|fp8), split it with "
        "--tensor-parallel-size, use a smaller dtype (bfloat16/float16 instead of float32), raise "
        "gpu_memory_utilization, or free the GPU.", param="gpu_memory_utilization")


def device_memory_check(config: EngineConfig) -> Callable[[int], None] | None:
    """``build_model``'s ``check_fits`` for a CUDA device (None on CPU, where memory is not reserved)."""
    if not config.device.startswith("cuda"):
        return None

    def check(weights_bytes: int) -> None:
        free, total = torch.cuda.mem_get_info(torch.device(config.device))
        check_weights_fit(weights_bytes, free, total, config.cache.gpu_memory_utilization)
    return check
