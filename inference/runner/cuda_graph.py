"""CUDA graphs for decode steps: captured once per batch-size bucket, replayed with padded inputs.

Only decode-only steps (one token per request) are replayed; prefills run eagerly. Inputs are
copied into persistent buffers; padding rows get slot ``-1`` (the store kernel skips them) and
sequence length 0 (the decode kernel writes zeros for them), so padding never touches the cache.
"""
from __future__ import annotations

import logging

import torch

from ..attention import AttentionMetadata
from .input_batch import ModelInput

logger = logging.getLogger(__name__)


def decode_split_plan(batch: int, sizes: list[int], num_kv_heads: int, max_seq_len: int, device) -> int:
    """KV splits of the decode kernel for a batch of ``batch`` requests, chosen as the CUDA graph of
    its bucket chose them, so that eager and graph decode steps compute exactly the same sums."""
    from ..attention.triton_ops import choose_num_splits
    bucket = next((s for s in sizes if s >= batch), batch)
    return choose_num_splits(bucket, num_kv_heads, max_seq_len, torch.device(device))


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, then every 16 up to ``max_num_seqs`` (which is always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def reset_graphs(graphs: dict) -> None:
    """Wait for the device, destroy each captured graph of ``graphs`` (values: ``torch.cuda.CUDAGraph``), and
    empty the dict; nothing when it is empty."""
    if graphs:
        torch.cuda.synchronize()
        for graph in graphs.values():
            graph.reset()
        graphs.clear()


class CudaGraphRunner:
    """Captures ``model.forward`` for decode batches and replays it.

    Args:
        model: the causal LM (its forward must be capturable: no host syncs).
        kv_caches: the per-layer cache tensors the graphs write into.
        max_num_seqs: largest batch captured.
        max_blocks: block-table width, ``ceil(max_model_len / block_size)``.
    """

    def __init__(self, model, kv_caches: list[torch.Tensor], max_num_seqs: int, max_blocks: int,
                 block_size: int, num_kv_heads: int, device: str) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_seq_len = max_blocks * block_size
        self.num_kv_heads = num_kv_heads
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((self.max_batch,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(self.max_batch, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, batch: int) -> AttentionMetadata:
        empty = self.input_ids[:0]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], decode_indices=empty, decode_block_tables=empty,
            decode_seq_lens=empty, prefills=[], block_size=self.block_size, backend="triton",
            block_tables=self.block_tables[:batch], seq_lens=self.seq_lens[:batch],
            max_query_len=1, max_seq_len=self.max_seq_len, decode_only=True,
            num_splits=decode_split_plan(batch, self.sizes, self.num_kv_heads, self.max_seq_len,
                                         self.input_ids.device))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first, sharing one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        self.seq_lens.fill_(1)
        for batch in reversed(self.sizes):
            meta = self._metadata(batch)
            args = (self.input_ids[:batch], self.positions[:batch], self.kv_caches, meta)
            self.model(*args)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self.model(*args)
            self.graphs[batch] = graph
        self.seq_lens.zero_()
        torch.cuda.synchronize()
        logger.info("Captured CUDA graphs for decode batch sizes %s", self.sizes)

    def release(self) -> None:
        """Destroy the captured graphs (idempotent). Must run before the tensor-parallel communicators
        are torn down: graphs holding captured NCCL all-reduces keep ``ncclCommAbort``/destroy from
        returning (pytorch/pytorch#115388); the runner falls back to eager steps afterwards."""
        reset_graphs(self.graphs)
        self.outputs.clear()

    def can_run(self, inputs: ModelInput) -> bool:
        if not self.graphs:
            return False
        return inputs.meta.decode_only and 0 < inputs.input_ids.shape[0] <= self.max_batch

    def load_inputs(self, inputs: ModelInput) -> int:
        """Copy a decode batch of ``B`` requests into the persistent buffers, rows ``B`` up to the
        smallest bucket that fits marked as padding; returns that bucket."""
        batch = inputs.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= batch)
        meta = inputs.meta
        self.input_ids[:batch].copy_(inputs.input_ids)
        self.positions[:batch].copy_(inputs.positions)
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.slot_mapping[batch:size].fill_(-1)
        width = meta.block_tables.shape[1]
        self.block_tables[:batch, :width].copy_(meta.block_tables)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        self.seq_lens[batch:size].zero_()
        return size

    def run(self, inputs: ModelInput) -> torch.Tensor:
        """Replay the smallest graph that fits; returns hidden states ``[B, H]`` (a view of the graph output)."""
        size = self.load_inputs(inputs)
        self.graphs[size].replay()
        return self.outputs[size][:inputs.input_ids.shape[0]]
