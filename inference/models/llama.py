"""The Llama family of decoder-only transformers: Llama 2/3, Mistral, Qwen2/2.5 and Qwen3.

One implementation with per-architecture switches read from the Hugging Face config:
Qwen2 adds a bias to the Q/K/V projections, Qwen3 normalises each query and key head
(RMSNorm over ``head_dim``) before rotary embedding, Llama 3 scales RoPE frequencies.
Q/K/V and gate/up projections are fused into one matmul each; each layer knows how to
load the separate Hugging Face tensors into its fused weight. With tensor parallelism
(``tp``, see :mod:`.parallel_layers`) each rank holds its heads, its part of the MLP and of
the vocabulary; ``o_proj`` and ``down_proj`` all-reduce.
"""
from __future__ import annotations

import torch
from torch import nn

from ..attention import AttentionMetadata, paged_attention
from ..attention.kv_scales import checkpoint_scale_target, record_amax, scale_value
from ..distributed.process_group import TensorParallelGroup
from .layers import RMSNorm, RotaryEmbedding, RotaryPositions, silu_and_mul
from .parallel_layers import (SINGLE_RANK, MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                              RowParallelLinear, VocabParallelEmbedding, parallel_logits)


class DecoderAttention(nn.Module):
    def __init__(self, config, arch: str, rotary: RotaryEmbedding, tp: TensorParallelGroup) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        bias = bool(getattr(config, "attention_bias", False)) or arch == "Qwen2ForCausalLM"
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv_heads, bias, tp)
        self.num_heads = self.qkv_proj.partition.num_heads  # this rank's heads
        self.num_kv_heads = self.qkv_proj.partition.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q_start = self.qkv_proj.partition.q_start * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden,
                                        bool(getattr(config, "attention_bias", False)) and arch != "Qwen2ForCausalLM",
                                        tp, in_range=(q_start, q_start + self.q_size))
        self.qk_norm = arch == "Qwen3ForCausalLM"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary  # shared by all layers
        self.scale = self.head_dim ** -0.5
        self.k_scale = self.v_scale = 1.0  # an FP8 KV cache's scales (inference.attention.kv_scales)
        self.kv_amax: torch.Tensor | None = None  # [2] float32 while the scales are calibrated

    def project(self, rope: RotaryPositions, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's queries ``[T, Hq, D]``, keys and values ``[T, Hk, D]`` (rotary applied), model dtype.
        On the Triton backend the keys and values are also stored in ``kv_cache`` here (through
        ``meta.slot_mapping`` only: the rest of ``meta`` is not read, so piecewise CUDA graphs capture this)."""
        num_tokens = x.codes.shape[0] if hasattr(x, "codes") else x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.kv_amax is not None:
            record_amax(self.kv_amax, k, v)
        # With the Triton backend the rotary layer stores the step's keys and values (on CUDA in its own
        # kernel: one launch less a layer).
        fused_store = meta.backend == "triton"
        return (*self.rotary(rope, q, k, (v, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
                             if fused_store else None), v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of :meth:`project`'s output over the paged cache: ``[T, Hq, D]`` (into ``out`` if given)."""
        return paged_attention(q, k, v, kv_cache, meta, self.scale, kv_stored=meta.backend == "triton",
                               k_scale=self.k_scale, v_scale=self.v_scale, out=out)

    def forward(self, rope: RotaryPositions, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.project(rope, x, kv_cache, meta)
        return self.o_proj(self.attend(q, k, v, kv_cache, meta).reshape(q.shape[0], self.q_size))


class GatedMLP(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup) -> None:
        super().__init__()
        inter = config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, {"gate_proj": inter, "up_proj": inter},
                                                       bias, tp)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, tp,
                                           in_range=self.gate_up_proj.shard_ranges["gate_proj"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp8 = getattr(self.down_proj, "takes_fp8_activations", False)
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), fp8_out=fp8))


class DecoderLayer(nn.Module):
    def __init__(self, config, arch: str, rotary: RotaryEmbedding, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, arch, rotary, tp)
        self.mlp = GatedMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def before_attention(self, rope, hidden, residual, kv_cache, meta):
        """The input norm and the attention's projections: ``(q, k, v, residual)`` (see
        ``DecoderAttention.project``); ``residual`` None in the first layer (``hidden`` is the embedding)."""
        # An FP8 layer after a norm gets its input quantized by the norm's kernel (Fp8Activation).
        fp8_qkv = getattr(self.self_attn.qkv_proj, "takes_fp8_activations", False)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, fp8_out=fp8_qkv)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, fp8_out=fp8_qkv)
        return (*self.self_attn.project(rope, hidden, kv_cache, meta), residual)

    def after_attention(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``attn [T, Hq * D]`` through ``o_proj``, the residual add, the post-attention norm and the MLP:
        ``(hidden, residual)`` ``[T, H]``."""
        hidden, residual = self.post_attention_layernorm(
            self.self_attn.o_proj(attn), residual,
            fp8_out=getattr(self.mlp.gate_up_proj, "takes_fp8_activations", False))
        return self.mlp(hidden), residual

    def forward(self, rope, hidden, residual, kv_cache, meta):
        q, k, v, residual = self.before_attention(rope, hidden, residual, kv_cache, meta)
        attn = self.self_attn.attend(q, k, v, kv_cache, meta)
        return self.after_attention(attn.reshape(q.shape[0], self.self_attn.q_size), residual)


class DecoderModel(nn.Module):
    def __init__(self, config, arch: str, max_position: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(config, head_dim, max_position)
        self.layers = nn.ModuleList(DecoderLayer(config, arch, self.rotary_emb, tp)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


class LlamaFamilyForCausalLM(nn.Module):
    """Causal LM over a flattened batch with a paged KV cache.

    ``forward(input_ids [T] int64, positions [T] int64, kv_caches, meta) -> hidden [T, H]``;
    ``compute_logits(hidden [N, H]) -> [N, vocab]`` in the model dtype (None on tensor-parallel ranks other
    than 0, which must still call it: the ranks gather the logits together).

    Args:
        tp: this rank's tensor-parallel group (a single rank by default).
    """

    def __init__(self, config, arch: str, max_position: int, tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = DecoderModel(config, arch, max_position, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.kv_scales_from_checkpoint = False  # load_weights found an FP8 KV cache's scales
        self.lm_head_lt_rows: frozenset[int] = frozenset()  # the LM head's cuBLASLt row counts (blas_choice)
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        hidden, rope = self.embed(input_ids, positions)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, RotaryPositions]:
        """The tokens' embeddings ``[T, H]`` and their rotary positions (the tables' rows on the PyTorch path,
        gathered once for all layers)."""
        hidden = self.model.embed_tokens(input_ids)
        return hidden, self.model.rotary_emb.at(positions, hidden.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return parallel_logits(hidden, self.lm_head_weight, self.config.vocab_size, self.tp, self.lm_head_lt_rows)

    def load_weights(self, weights) -> set[str]:
        """Copy Hugging Face named tensors into this model (fusing Q/K/V and gate/up; each
        tensor-parallel layer takes its rank's part of the full tensor).

        Args:
            weights: iterable of ``(hf_name, tensor)``.
        Returns:
            The set of this model's parameter names that were loaded.
        Raises:
            ValueError: a tensor of the wrong shape.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            kv_scale = checkpoint_scale_target(name)
            if kv_scale is not None:  # an FP8 KV cache's scales (used only with one)
                attention, which = kv_scale
                for kind in which:
                    setattr(self.get_submodule(attention), f"{kind}_scale", scale_value(tensor, name))
                self.kv_scales_from_checkpoint = True
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in _FUSED:
                shard = parts[-2]
                module_name = ".".join(parts[:-2] + [_FUSED[shard]])
                module = self.get_submodule(module_name)
                module.load_shard(shard, parts[-1], tensor)
                loaded.add(f"{module_name}.{parts[-1]}")
                continue
            if name not in params:
                continue
            module_name, _, param_name = name.rpartition(".")
            module = self.get_submodule(module_name)
            if hasattr(module, "load_weight"):
                module.load_weight(param_name, tensor)
            else:
                param = params[name]
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
                with torch.no_grad():
                    param.copy_(tensor)
            loaded.add(name)
        return loaded
