"""Benchmark knobs: command-line options that change module constants of the engine before it is built, for
side-by-side runs of one workload (``throughput.py``, ``late_requests.py``). None of them is an engine flag."""
from __future__ import annotations

import argparse

import torch

from inference.sched import decode_windows


def add_engine_knob_args(parser: argparse.ArgumentParser) -> None:
    """Benchmark knobs that change module constants of the engine, for side-by-side runs."""
    parser.add_argument("--window-target-ms", type=float, default=None,
                        help="override the longest time an engine-sized decode window lasts "
                             "(decode_windows.WINDOW_TARGET_S; a benchmark knob)")
    parser.add_argument("--no-piecewise-graphs", action="store_true",
                        help="steps that compute prompt tokens run eagerly, not as piecewise CUDA graphs "
                             "(runner/piecewise_graph.py; a benchmark knob)")
    parser.add_argument("--window-clock", choices=["device", "wall"], default=None,
                        help="what sizes engine-sized decode windows: each launch's device time (the default on a "
                             "GPU) or the wall time between launches (decode_windows.WINDOW_CLOCK; a benchmark knob)")
    parser.add_argument("--window-host-cover", type=float, default=None,
                        help="engine-sized decode windows last on the device at least this many times the host's time "
                             "per iteration (decode_windows.HOST_COVER; default 0: off; a benchmark knob)")
    parser.add_argument("--blas-library", choices=["cublas", "cublaslt"], default=None,
                        help="torch.backends.cuda.preferred_blas_library for the dense layers (a benchmark knob)")
    parser.add_argument("--no-blas-choice", action="store_true",
                        help="keep every dense GEMM on cuBLAS instead of timing cuBLASLt against it per layer shape and "
                             "captured row count at start-up (models/blas_choice.py; a benchmark knob)")
    parser.add_argument("--no-window-graphs", action="store_true",
                        help="multi-step windows step by step, not as one CUDA graph (runner/window_graph.py)")
    parser.add_argument("--decode-programs-per-sm", type=int, default=None,
                        help="override the decode attention's KV-split target (triton_decode.PROGRAMS_PER_SM)")
    parser.add_argument("--window-graphs-longest-only", action="store_true",
                        help="capture window graphs for the longest window length only; shorter engine-sized "
                             "windows run step by step (runner/window_graph.py; a benchmark knob)")


def apply_engine_knobs(args) -> None:
    if args.window_target_ms is not None:
        decode_windows.WINDOW_TARGET_S = args.window_target_ms / 1000
    if args.no_piecewise_graphs:
        from inference.runner import piecewise_graph
        piecewise_graph.ENABLED = False
    if args.window_clock is not None:
        decode_windows.WINDOW_CLOCK = args.window_clock
    if args.window_host_cover is not None:
        decode_windows.HOST_COVER = args.window_host_cover
    if args.blas_library is not None:
        torch.backends.cuda.preferred_blas_library(args.blas_library)
    if args.no_blas_choice:
        from inference.models import blas_choice
        blas_choice.ENABLED = False
    if args.no_window_graphs:
        from inference.runner import window_graph
        window_graph.ENABLED = False
    if args.decode_programs_per_sm is not None:
        from inference.attention import triton_decode
        triton_decode.PROGRAMS_PER_SM = args.decode_programs_per_sm
    if args.window_graphs_longest_only:
        from inference.runner import window_graph
        window_graph.LONGEST_ONLY = True
