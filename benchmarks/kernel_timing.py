"""Timing, error and test-layer helpers shared by the kernel microbenchmarks in this folder (quant_kernels.py,
w4a16_sweep.py, gemm_sweep.py, fp8_gemm_layouts.py, launch_floor.py, w4a16_*.py).

Timing replays one CUDA graph of the calls: no launch overhead, and over enough copies of the weights
(``ROTATE_BYTES`` together) that L2 cannot serve them, as in a decode step. Only torch is imported here;
``int4_layer`` imports the engine's quantization modules when called (after a script's own set-up, e.g.
w4a16_sweep.py's Triton-interpreter fix for ``--smoke``).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from inference.quantization.linear import QuantizedLinear

ROTATE_BYTES = 256 << 20  # bytes: the weight copies one timed graph cycles through hold at least this much (> L2)
GROUP = 128  # int4_layer's quantization group size (input features per scale and zero point)


def graph_ms(calls: list) -> float:
    """Milliseconds per call of ``calls`` (closures) replayed from one CUDA graph, median of 5 timings of 4 replays
    (each call run once first, outside the graph, to compile and warm up). CUDA only."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(4):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (4 * len(calls)))
    return sorted(times)[2]


def calls_ms(calls: list, device: str) -> float:
    """Milliseconds per call: replayed from one CUDA graph of ``calls``, median of 5 timings of 4 replays
    (CPU smoke runs: one wall-clock pass)."""
    if device == "cuda":
        return graph_ms(calls)
    start = time.perf_counter()
    for call in calls:
        call()
    return 1000 * (time.perf_counter() - start) / len(calls)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|``, unitless (``out`` cast to float32; ``ref`` the float32 reference)."""
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()


def int4_bytes(layer: QuantizedLinear) -> int:
    """Bytes of an int4 layer's weights as a kernel reads them: codes, scales and zero points."""
    return sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scales, layer.qzeros))


def int4_layer(K: int, N: int, generator: torch.Generator, device: str, desc_act: bool = False) -> QuantizedLinear:
    """A loaded AWQ layer (GPTQ with a shuffled ``g_idx`` when ``desc_act``) of random codes, scales in
    [0.002, 0.006] and random zero points, in the engine's internal layout."""
    from inference.quantization import QuantizationConfig, packing
    from inference.quantization.int4 import Int4LinearMethod
    from inference.quantization.linear import QuantizedLinear

    method = "gptq" if desc_act else "awq"
    with torch.device(device):
        layer = QuantizedLinear(K, N, False, Int4LinearMethod(QuantizationConfig(method, group_size=GROUP,
                                                                                desc_act=desc_act)),
                                torch.bfloat16)
        layer.init_dummy(generator)
        with torch.no_grad():
            layer.scales.uniform_(0.002, 0.006, generator=generator)
            layer.qzeros.random_(-2 ** 31, 2 ** 31 - 1, generator=generator)
            if desc_act:
                order = torch.randperm(K, generator=generator, device=device)
                layer.g_idx.copy_(packing.group_index(K, GROUP, device)[order])
        layer.method.process_weights_after_loading(layer)
    return layer
