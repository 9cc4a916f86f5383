"""Dequantize a GGUF file's tensors and give them Hugging Face names and layouts.

Layout facts this module relies on (GGUF spec, ggml-org/ggml docs/gguf.md, and
llama.cpp's ``convert_hf_to_gguf.py``):

* ggml lists a tensor's dimensions fastest-varying first (``ne[0]`` is the row length),
  the reverse of numpy/torch order. A Hugging Face ``nn.Linear`` weight of shape
  ``(out_features, in_features)`` is stored with ggml shape ``[in_features,
  out_features]``; the bytes are the same row-major matrix.
* For the ``llama`` (and ``mistral``) architectures the converter permutes the rows of
  the Q and K projections so llama.cpp can apply RoPE to adjacent pairs
  ``(x[2i], x[2i+1])``; Hugging Face rotates the two halves ``(x[i], x[i + d/2])`` of
  each head. ``unpermute_rope_rows`` undoes it. Qwen2/Qwen3 GGUFs are written without
  the permutation (their llama.cpp graph uses the "neox" rotation, like Hugging Face).
"""
from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from ..errors import ModelLoadError

# GGUF architectures whose Q/K rows llama.cpp's converter permutes.
PERMUTED_ROPE_ARCHITECTURES = frozenset({"llama", "mistral"})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_MODULES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str:
    """Map a GGUF tensor name to its Hugging Face name.

    ``"blk.3.attn_q.weight"`` → ``"model.layers.3.self_attn.q_proj.weight"``,
    ``"token_embd.weight"`` → ``"model.embed_tokens.weight"``.

    Raises:
        ModelLoadError: a tensor the supported architectures do not have (for instance
            ``rope_freqs.weight``, Llama 3's RoPE frequency factors, which the Hugging
            Face config would have to express as ``rope_scaling``).
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_MODULES:
        layer, module, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_MODULES[module]}.{kind}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in the supported architectures.")


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's RoPE row permutation of a Q or K projection.

    Within each head of ``head_dim`` rows, GGUF row ``2 * i + j`` holds Hugging Face row
    ``j * head_dim // 2 + i`` (``i < head_dim // 2``, ``j`` in ``{0, 1}``).

    Args:
        weight: ``(num_heads * head_dim, ...)`` rows in GGUF order; a weight
            ``(rows, hidden_size)`` or a bias ``(rows,)``.
        num_heads: heads in this projection (``num_key_value_heads`` for K).

    Returns:
        A new contiguous tensor of the same shape and dtype, rows in Hugging Face order.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(f"Cannot unpermute {rows} rows into {num_heads} heads of even size.")
    half = rows // num_heads // 2
    per_pair = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return per_pair.transpose(1, 2).reshape(weight.shape).contiguous()


def iter_gguf_tensors(
    reader, architecture: str, num_heads: int, num_kv_heads: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of a GGUF file, dequantized.

    Args:
        reader: an open ``gguf.GGUFReader``.
        architecture: the file's ``general.architecture`` (decides the Q/K unpermute).
        num_heads, num_kv_heads: attention heads of Q and of K/V.

    Yields:
        float32 CPU tensors in numpy/torch dimension order (ggml order reversed),
        owning their memory (not views of the memory-mapped file).

    Raises:
        ModelLoadError: an unknown tensor name, a quantization type the ``gguf``
            library cannot dequantize, or a tensor whose size disagrees with its shape.
    """
    from gguf.quants import dequantize

    unpermute = architecture in PERMUTED_ROPE_ARCHITECTURES
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        shape = tuple(int(dim) for dim in reversed(tensor.shape))
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ModelLoadError(f"GGUF tensor {tensor.name}: {exc}") from exc
        if values.size != int(np.prod(shape)):
            raise ModelLoadError(f"GGUF tensor {tensor.name} holds {values.size} values, expected shape {shape}.")
        # np.array copies: F32 tensors come back as read-only views of the mapped file.
        weight = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
        if unpermute and ".self_attn.q_proj." in name:
            weight = unpermute_rope_rows(weight, num_heads)
        elif unpermute and ".self_attn.k_proj." in name:
            weight = unpermute_rope_rows(weight, num_kv_heads)
        yield name, weight
