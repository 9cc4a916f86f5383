"""Piecewise CUDA graphs for steps that compute prompt tokens: each layer's dense part replayed, attention eager.

The decode graphs (:mod:`.cuda_graph`) replay only steps of one token per request. A step that also
computes a prompt chunk (a request arriving while others decode, or a single prompt into an idle engine)
ran eagerly: about a dozen launches a layer, each with its Python overhead. At Qwen2.5-0.5B's size the host
is the slower side: a late request's mixed step into W2 left the H100 idle in 255 gaps over 20 µs, 28 ms
in all (``late-requests-profile_h100_2026-12-06.json``), and one 128-token prompt into the idle engine
took 13 ms to its first token.

Attention cannot be captured once per token count: its grid and its split of rows between the decode and
the prefill kernels follow the step's query lengths. Everything else in a layer is row-wise. So, as vLLM V1
does by default ("piecewise" CUDA graphs, split at attention), a bucket of ``T`` tokens gets ``L + 1``
graphs for an ``L``-layer model:

- graph 0 embeds the tokens and runs layer 0 up to attention: input norm, QKV projection, rotary and the
  store of the step's keys and values in the paged cache (``DecoderLayer.before_attention``);
- graph ``i`` runs the rest of layer ``i - 1`` (``o_proj``, residual add, norm, MLP:
  ``DecoderLayer.after_attention``) and layer ``i`` up to attention;
- graph ``L`` ends the last layer and applies the final norm.

Between them attention runs eagerly on the step's real rows with the step's own metadata, reading the
queries, keys and values from persistent buffers and writing its output into one. Padding rows (up to the
bucket) have slot -1 (the store skips them) and position 0; attention never reads them, and every other
operation treats rows independently, so they never touch the real rows. Buckets: 8, 16, 24, 32, every 32
up to 256, every 64 up to 512 (vLLM captures up to 512 tokens by default too), at most
``max_num_batched_tokens``; larger steps run eagerly (their kernels outlast the host's launches).

What the graphs fix at capture: the layers' weights, the KV cache tensors and an FP8 cache's scales (set
before capture, never changed after). Kernels that are chosen by row count (cuBLAS's algorithms, the W4A16
paths) are chosen by the bucket's, so a step's last bits can differ from an eager step of its exact size, as
they differ between eager batches of different sizes; the greedy tokens of ``gpu_check.py`` are the same.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from ..attention import AttentionMetadata
from .input_batch import ModelInput

logger = logging.getLogger(__name__)
ENABLED = True  # a benchmark knob (--no-piecewise-graphs): capture the piecewise graphs at all
MAX_TOKENS = 512


def piecewise_token_sizes(max_num_batched_tokens: int) -> list[int]:
    """The token buckets: 8, 16, 24, 32, every 32 up to 256, every 64 up to 512, none above
    ``max_num_batched_tokens`` (which is included when it is smaller than 512)."""
    sizes = [8, 16, 24] + list(range(32, 257, 32)) + list(range(320, MAX_TOKENS + 1, 64))
    limit = min(max_num_batched_tokens, MAX_TOKENS)
    return sorted({s for s in sizes if s < limit} | {limit})


class PiecewiseGraphRunner:
    """Captures each bucket's ``L + 1`` graphs and replays them around eager attention.

    Args:
        model: a Llama-family causal LM (``embed``, ``model.layers``' ``before_attention`` /
            ``after_attention``, ``model.norm``) whose dense layers are capturable (no host syncs).
        kv_caches: the per-layer cache tensors.
        sizes: the token buckets, ascending.
        block_size: tokens per KV block.
        backend: the step's attention backend (``"triton"``: the rotary kernel stores the keys and values
            inside the graphs; ``"torch"``: attention stores them).
        graph_factory: makes a graph object with ``capture(fn)`` and ``replay()``; CUDA graphs by default
            (tests on the CPU pass one that calls ``fn`` at each replay).
    """

    def __init__(self, model, kv_caches: list[torch.Tensor], sizes: list[int], block_size: int,
                 backend: str = "triton", graph_factory: Callable[[], "_Graph"] | None = None) -> None:
        self.model = model
        self.layers = list(model.model.layers)
        self.kv_caches = kv_caches
        self.sizes = sizes
        self.max_tokens = sizes[-1]
        self.block_size = block_size
        self.graph_factory = graph_factory or _CudaGraph
        attn = self.layers[0].self_attn
        weight = model.model.norm.weight
        device, dtype, rows = weight.device, weight.dtype, self.max_tokens
        self.backend = backend
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.q = torch.zeros(rows, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(rows, attn.num_kv_heads, attn.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.attn = torch.zeros_like(self.q)
        self.residual = torch.zeros(rows, weight.shape[0], dtype=dtype, device=device)
        self.hidden = torch.zeros_like(self.residual)
        self.graphs: dict[int, list] = {}

    def _metadata(self, size: int) -> AttentionMetadata:
        # All that the captured parts read of the metadata: the slots the rotary kernel stores to, the backend.
        empty = self.input_ids[:0]
        return AttentionMetadata(slot_mapping=self.slot_mapping[:size], decode_indices=empty,
                                 decode_block_tables=empty, decode_seq_lens=empty, prefills=[],
                                 block_size=self.block_size, backend=self.backend)

    def _segment(self, index: int, size: int, meta: AttentionMetadata) -> None:
        """Graph ``index`` of bucket ``size``: the rest of layer ``index - 1`` (or the embedding), then
        layer ``index`` up to attention (or the final norm), results in the persistent buffers."""
        n = size
        if index == 0:
            hidden, rope = self.model.embed(self.input_ids[:n], self.positions[:n])
            residual = None
        else:
            hidden, residual = self.layers[index - 1].after_attention(self.attn[:n].view(n, -1), self.residual[:n])
            rope = self.model.model.rotary_emb.at(self.positions[:n], self.hidden.dtype)
        if index == len(self.layers):
            hidden, _ = self.model.model.norm(hidden, residual)
            self.hidden[:n].copy_(hidden)
            return
        q, k, v, residual = self.layers[index].before_attention(rope, hidden, residual, self.kv_caches[index], meta)
        for buffer, value in ((self.q, q), (self.k, k), (self.v, v), (self.residual, residual)):
            if value.data_ptr() != buffer.data_ptr():  # the fused norm may have updated the buffer in place
                buffer[:n].copy_(value)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's graphs, largest first, in one memory pool. The slots are all -1
        meanwhile, so neither the warm-up nor the capture writes the KV cache."""
        pool = torch.cuda.graph_pool_handle() if self.graph_factory is _CudaGraph else None
        self.slot_mapping.fill_(-1)
        self.positions.zero_()
        for size in reversed(self.sizes):
            meta = self._metadata(size)
            for index in range(len(self.layers) + 1):  # warm-up: builds the kernels outside the capture
                self._segment(index, size, meta)
            graphs = []
            for index in range(len(self.layers) + 1):
                graph = self.graph_factory()
                graph.capture(lambda i=index, n=size, m=meta: self._segment(i, n, m), pool)
                graphs.append(graph)
            self.graphs[size] = graphs
        logger.info("Captured piecewise CUDA graphs for token counts %s", self.sizes)

    def release(self) -> None:
        """Destroy the captured graphs (idempotent)."""
        if self.graphs and self.graph_factory is _CudaGraph:
            torch.cuda.synchronize()
            for graphs in self.graphs.values():
                for graph in graphs:
                    graph.reset()
        self.graphs.clear()

    def can_run(self, inputs: ModelInput) -> bool:
        """A step that is not decode-only, of at most the largest bucket's tokens."""
        return bool(self.graphs) and not inputs.meta.decode_only and 0 < inputs.input_ids.shape[0] <= self.max_tokens

    def run(self, inputs: ModelInput) -> torch.Tensor:
        """The step's hidden states ``[T, H]`` (a view of a persistent buffer: read it before the next step)."""
        n = inputs.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(inputs.meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.positions[n:size].zero_()
        graphs = self.graphs[size]
        for index, layer in enumerate(self.layers):
            graphs[index].replay()
            layer.self_attn.attend(self.q[:n], self.k[:n], self.v[:n], self.kv_caches[index], inputs.meta,
                                   out=self.attn[:n])
        graphs[-1].replay()
        return self.hidden[:n]


class _Graph:
    """What the runner needs of a graph: capture a function once, replay it."""

    def capture(self, fn: Callable[[], None], pool) -> None: ...

    def replay(self) -> None: ...


class _CudaGraph(_Graph):
    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], None], pool) -> None:
        with torch.cuda.graph(self.graph, pool=pool):
            fn()

    def replay(self) -> None:
        self.graph.replay()

    def reset(self) -> None:
        self.graph.reset()
