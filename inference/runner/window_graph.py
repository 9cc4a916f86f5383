"""A whole multi-step decode window as one CUDA graph: ``N`` steps, greedy sampling included.

A window of :mod:`.multi_step` launches, per step, the decode graph's input copies, its replay, the
LM head, the argmax and the small tensor ops that make the next step's inputs: about twenty launches
a step from the host. At Qwen2.5-0.5B's size (W2) a 256-request decode step is about 2 ms of kernels
and the host fell behind: over 32 windows the H200 was busy 68% of the time, with idle gaps of
0.02-6 ms between kernels (``w2-n4-kernel-profile_h200_2026-12-01.json``, under the profiler).

Here the ``N`` steps of a window of greedy requests are captured once per batch bucket and window length (every
length the engine can choose: 2, 4 and 8 steps for engine-sized windows, the user's ``--num-scheduler-steps``
otherwise):
step ``k + 1``'s positions, sequence lengths, slots and input tokens are computed in the graph from
step ``k``'s, exactly as :func:`.multi_step.next_decode_inputs` computes them, and the greedy argmax
(the Triton one of :mod:`inference.sampling.triton_argmax`: in a graph its two launches cost no host
time) writes each step's tokens into a persistent ``[B, N]`` buffer. A window is then the decode
graph's input copies and one replay. Padding rows of the bucket keep sequence length 0 and slot -1 (they
store nothing and read nothing), their positions start at 0.

Windows of other lengths (cut near ``max_model_len``), sampled (non-greedy) or logit-processed
requests, and tensor parallelism take the step-by-step path. (Graphs for the longest length only left the 4-step
windows that W2 mostly runs at 12 ms step by step; on the H200 that measured within W2's run-to-run spread,
``w2-window-graphs-*_h200_2026-12-06_*.json``.)
"""
from __future__ import annotations

import logging

import torch

from .cuda_graph import CudaGraphRunner, reset_graphs
from .input_batch import ModelInput
from .multi_step import MultiStepHandle

logger = logging.getLogger(__name__)
ENABLED = True  # a benchmark knob (benchmarks/throughput.py --no-window-graphs): capture window graphs at all
LONGEST_ONLY = False  # a benchmark knob (--window-graphs-longest-only): graphs for the longest length only


class DecodeWindowGraphs:
    """Window graphs over a :class:`CudaGraphRunner`'s persistent input buffers.

    Args:
        graphs: the decode-step graph runner (its buffers are the windows' inputs).
        compute_logits: ``hidden [B, H] -> logits [B, V]`` (the model's LM head, one rank).
        lengths: the window lengths ``N`` captured (:func:`~inference.sched.decode_windows.window_lengths`).
    """

    def __init__(self, graphs: CudaGraphRunner, compute_logits, lengths: list[int]) -> None:
        self.graphs = graphs
        self.compute_logits = compute_logits
        self.lengths = sorted(lengths)
        self.tokens = torch.zeros(graphs.max_batch, self.lengths[-1], dtype=torch.long,
                                  device=graphs.input_ids.device)
        self.windows: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # by (window length, batch bucket)
        from ..sampling.triton_argmax import greedy_argmax  # Triton: imported only where windows are built
        self.argmax = greedy_argmax

    def _advance(self, size: int, live: torch.Tensor, ones: torch.Tensor, step: int) -> None:
        # The next step's inputs, in place: next_decode_inputs on the graph's buffers. Padding rows stay
        # inert: position 0 (block-table column 0 and rotary row 0 exist whatever the window length), length
        # 0, slot -1.
        g = self.graphs
        positions = g.positions[:size]
        positions += ones
        g.seq_lens[:size] += ones
        blocks = g.block_tables[:size].gather(1, (positions // g.block_size)[:, None]).squeeze(1).long()
        g.slot_mapping[:size].copy_(torch.where(live, blocks * g.block_size + positions % g.block_size, -1))
        g.input_ids[:size].copy_(self.tokens[:size, step - 1])

    def _window(self, num_steps: int, size: int) -> None:
        g = self.graphs
        meta = g._metadata(size)
        live = g.seq_lens[:size] > 0  # the batch's rows; padding rows have length 0
        ones = live.int()
        for step in range(num_steps):
            if step:
                self._advance(size, live, ones, step)
            hidden = g.model(g.input_ids[:size], g.positions[:size], g.kv_caches, meta)
            self.argmax(self.compute_logits(hidden), out=self.tokens[:size, step])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one window graph per window length and bucket, longest and largest first, in one memory
        pool (one window runs at a time). The buffers hold padding rows (sequence length 0, slot -1) meanwhile,
        so the warm-up writes no cache slot."""
        g = self.graphs
        pool = torch.cuda.graph_pool_handle()
        for num_steps in reversed(self.lengths):
            for size in reversed(g.sizes):
                self._padding_only()
                self._window(num_steps, size)  # warm-up outside the capture (the LM head and argmax at this size)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._window(num_steps, size)
                self.windows[num_steps, size] = graph
        self._padding_only()
        torch.cuda.synchronize()
        logger.info("Captured decode window graphs of %s steps for batch sizes %s", self.lengths, g.sizes)

    def _padding_only(self) -> None:
        g = self.graphs
        g.positions.zero_()
        g.seq_lens.zero_()
        g.slot_mapping.fill_(-1)

    def release(self) -> None:
        """Destroy the captured window graphs (idempotent)."""
        reset_graphs(self.windows)

    def can_run(self, inputs: ModelInput, num_steps: int, sampling_meta) -> bool:
        """A window of a captured length of a decode batch the graphs fit, every row plain greedy."""
        batch = inputs.input_ids.shape[0]
        return (num_steps in self.lengths and bool(self.windows) and sampling_meta is not None
                and sampling_meta.plain_greedy and inputs.meta.decode_only and 0 < batch <= self.graphs.max_batch
                and inputs.logits_indices.shape[0] == batch)

    def run(self, inputs: ModelInput, num_steps: int) -> MultiStepHandle:
        """Launch a window of ``num_steps`` (a captured length) of a decode batch ``B``; its ``[B, N]`` tokens
        come back as a multi-step window's."""
        batch = inputs.input_ids.shape[0]
        size = self.graphs.load_inputs(inputs)
        self.graphs.positions[batch:size].zero_()
        self.windows[num_steps, size].replay()
        tokens = self.tokens[:batch, :num_steps]
        # The handle must own its tokens: the next window launched ahead overwrites the buffer. On CUDA its
        # pinned copy to the host does, queued before that window; elsewhere (tests) a copy here.
        return MultiStepHandle(tokens if tokens.is_cuda else tokens.clone())
