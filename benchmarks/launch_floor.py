"""Fixed cost of one kernel inside a CUDA graph, on a GPU: chains of kernels that do (almost) nothing.

A decode step of W2's model (Qwen2.5-0.5B shape) runs 24 layers of 11 kernels plus the LM head and argmax,
about 270 launches, each replayed from a CUDA graph. This measures what one such launch costs when its own
work is nil, the floor under each of them: chains of ``--chain`` launches of a Triton kernel that stores one
element (one program, and one program per SM), and of a 1 x 64 x 64 bf16 GEMM through cuBLAS, each chain
captured in one CUDA graph and replayed (median of 5 timings of 4 replays; ``kernel_timing.graph_ms``).
Results in microseconds per launch.

    python benchmarks/launch_floor.py --output-json benchmarks/results/launch_floor_h200.json

Exits 2 without CUDA.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_timing import graph_ms  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _store_one_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chain", type=int, nargs="+", default=[16, 264], help="launches per CUDA graph")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("launch_floor.py needs a CUDA GPU")
        sys.exit(2)
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = torch.zeros(sms, device=device)
    x = torch.randn(1, 64, device=device, dtype=torch.bfloat16)
    w = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    cases = {"triton_store_1_program": lambda: _store_one_kernel[(1,)](out),
             f"triton_store_{sms}_programs": lambda: _store_one_kernel[(sms,)](out),
             "cublas_gemm_1x64x64_bf16": lambda: F.linear(x, w)}
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "device": torch.cuda.get_device_name(device), "us_per_launch": {}}
    for name, call in cases.items():
        for n in args.chain:
            us = 1000 * graph_ms([call] * n)
            result["us_per_launch"][f"{name}_chain_{n}"] = us
            print(f"{name:>32} x{n:4d}: {us:6.2f} us a launch", flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
