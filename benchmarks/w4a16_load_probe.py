"""How fast the W4A16 decode kernels' weights can be read at all: a kernel that only loads the packed int4 words
(``[K / 8, N]`` int32, the K-tiled layout's 16 word rows per 128-row K tile) and XOR-folds them, timed on the
Qwen2.5-7B gate_up and down shapes, against a device copy and bf16 cuBLAS at one row (GB/s of what each reads).

Variants: plain pointer loads of ``[16 * tiles, BLOCK_N]`` words an iteration (Triton's pipeliner, ``num_stages``),
and the same tiles through the Hopper TMA (a host-built tensor descriptor, ``--tma``, sm_90 only). The grid is
``N / BLOCK_N`` column tiles times a K split; each variant's result is checked against PyTorch's. CUDA only.

    python benchmarks/w4a16_load_probe.py --output-json benchmarks/results/w4a16-load-probe_h100_DATE.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from provenance import current_commit  # noqa: E402
from kernel_timing import graph_ms  # noqa: E402

SHAPES = (("gate_up", 3584, 37888), ("down", 18944, 3584))  # name, K, N


@triton.jit
def _load_kernel(q_ptr, out_ptr, N, tiles_per_split, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
                 STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, 16 * TILES)
    first = pid_k * tiles_per_split
    ptrs = q_ptr + (first * 16 + rows)[:, None].to(tl.int64) * N + offs_n[None, :]
    folded = tl.zeros((16 * TILES, BLOCK_N), dtype=tl.int32)
    for _ in tl.range(0, tiles_per_split // TILES, num_stages=STAGES):
        folded ^= tl.load(ptrs)
        ptrs += 16 * TILES * N
    tl.store(out_ptr + pid_k * N + offs_n, tl.xor_sum(folded, axis=0))


@triton.jit
def _tma_kernel(desc, out_ptr, N, tiles_per_split, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
                STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    first = pid_k * tiles_per_split
    folded = tl.zeros((16 * TILES, BLOCK_N), dtype=tl.int32)
    for i in tl.range(0, tiles_per_split // TILES, num_stages=STAGES):
        folded ^= desc.load([(first + i * TILES) * 16, pid_n * BLOCK_N])
    tl.store(out_ptr + pid_k * N + offs_n, tl.xor_sum(folded, axis=0))


def _xor_rows(q: torch.Tensor, split: int) -> torch.Tensor:
    """``[split, N]``: the XOR of each split's rows of ``q [rows, N]`` (the kernels' result)."""
    parts = q.view(split, -1, q.shape[1])
    while parts.shape[1] > 1:
        if parts.shape[1] % 2:
            parts = torch.cat([parts, torch.zeros_like(parts[:, :1])], dim=1)
        half = parts.shape[1] // 2
        parts = parts[:, :half] ^ parts[:, half:]
    return parts[:, 0]


def _gbps(nbytes: int, calls: list) -> float:
    return round(nbytes / (1e6 * graph_ms(calls)), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--tma", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("w4a16_load_probe needs a CUDA GPU")
    device = "cuda"
    result = {"command": "python " + shlex.join(sys.argv), "commit": current_commit(),
              "device": torch.cuda.get_device_name(), "unit": "GB/s read",
              "shapes": {}}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, K, N in SHAPES:
        copies = [torch.randint(0, 2 ** 31 - 1, (K // 8, N), dtype=torch.int32, device=device) for _ in range(4)]
        nbytes = copies[0].numel() * 4
        k_tiles = K // 128
        row: dict[str, float] = {}
        dst = torch.empty_like(copies[0])
        row["copy (read + write)"] = _gbps(2 * nbytes, [lambda q=q: dst.copy_(q) for q in copies])
        weights = [torch.randn(N, K, device=device, dtype=torch.bfloat16) for _ in range(2)]
        x = torch.randn(1, K, device=device, dtype=torch.bfloat16)
        row["bf16 cuBLAS, one row"] = _gbps(N * K * 2, [lambda w=w: torch.nn.functional.linear(x, w)
                                                        for w in weights])
        del weights
        variants = itertools.product(("load", "tma") if args.tma else ("load",), (128, 256, 512), (1, 2), (4, 8),
                                     (2, 4), (2, 4, 8))
        for kind, block_n, tiles, warps, stages, programs_per_sm in variants:
            split = max(1, min(k_tiles // tiles, round(programs_per_sm * sms / (N // block_n))))
            while k_tiles % (split * tiles):
                split -= 1
            per_split = k_tiles // split
            out = torch.empty(split, N, dtype=torch.int32, device=device)
            grid = (N // block_n, split)
            if kind == "tma":
                if torch.cuda.get_device_capability() < (9, 0):
                    continue
                from triton.tools.tensor_descriptor import TensorDescriptor
                descs = [TensorDescriptor.from_tensor(q, [16 * tiles, block_n]) for q in copies]
                calls = [lambda d=d: _tma_kernel[grid](d, out, N, per_split, BLOCK_N=block_n, TILES=tiles,
                                                       STAGES=stages, num_warps=warps) for d in descs]
            else:
                calls = [lambda q=q: _load_kernel[grid](q, out, N, per_split, BLOCK_N=block_n, TILES=tiles,
                                                        STAGES=stages, num_warps=warps) for q in copies]
            key = f"{kind} n{block_n} t{tiles} w{warps} s{stages} split{split}"
            try:
                calls[0]()
                if not torch.equal(out, _xor_rows(copies[0], split)):
                    raise AssertionError("wrong words read")
                row[key] = _gbps(nbytes, calls)
            except Exception as error:  # a variant that does not compile or fit is reported, not fatal
                row[key] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
        best = sorted(((v, k) for k, v in row.items() if isinstance(v, float)), reverse=True)[:8]
        print(name, "best:", best, "failed:", [k for k, v in row.items() if isinstance(v, str)], flush=True)
        result["shapes"][name] = row
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
