"""Where the W4A16 decode tile kernel's time goes: a stripped copy of its main loop with each stage switched off
in turn, timed on the Qwen2.5-7B gate_up and down shapes at 1 and 16 rows against the library kernel (int4 GB/s).

Stages: the MMA (``dot``; off: the operand is XOR-folded into registers instead), the dequantization (``deq``;
off: the packed words are used as the operand's bits), the per-tile epilogue (``scale``: the group's scale, zero
point and the all-ones MMA for sum(x); off: the MMA accumulates across tiles), and the x tile (``xonce``: loaded
once instead of per tile). Split-K partials are written, not reduced. CUDA only.

    python benchmarks/w4a16_stage_probe.py --output-json benchmarks/results/w4a16-stage-probe_h100_DATE.json
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference.quantization.triton_w4a16_decode import _group_params, _tile_operand, _x_tile, w4a16_decode  # noqa: E402
from inference.quantization.triton_w4a16_launch import DecodeConfig  # noqa: E402

from provenance import current_commit  # noqa: E402
from kernel_timing import graph_ms  # noqa: E402

SHAPES = (("gate_up", 3584, 37888, 128, 2), ("down", 18944, 3584, 64, 8))  # name, K, N, BLOCK_N, splits
STAGES = ((1, 0, 1, 1), (1, 1, 1, 1), (1, 0, 1, 0), (0, 0, 1, 0), (0, 0, 0, 0), (1, 0, 0, 0))  # dot, xonce, deq, scale


@triton.jit
def _probe_kernel(x_ptr, qweight_ptr, scales_ptr, qzeros_ptr, out_ptr, M, N, K, stride_xm, tiles_per_split,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
                  X_ONCE: tl.constexpr, DOT: tl.constexpr, DEQ: tl.constexpr, SCALE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kk = tl.arange(0, 128)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    folded = tl.zeros((BLOCK_N, 128), dtype=tl.int16)
    first = pid_k * tiles_per_split
    last = first + tiles_per_split
    xt = _x_tile(x_ptr, x_ptr, first, offs_kk, offs_m, mask_m, stride_xm, last, K, False, True)
    w_ptrs = qweight_ptr + (first * 16 + tl.arange(0, 16))[None, :].to(tl.int64) * N + offs_n[:, None]
    for t in range(first, last):
        words = tl.load(w_ptrs)
        w_ptrs += 16 * N
        if DEQ:
            a = _tile_operand(words, MAGIC, BLOCK_N, False, ASM=True)
        else:
            w = tl.reshape(words, (BLOCK_N, 2, 8))
            p = tl.join(tl.join(w, w), tl.join(w, w))
            a = tl.reshape(tl.permute(tl.join(p.to(tl.int16), p.to(tl.int16)), (0, 1, 4, 3, 2, 5)), (BLOCK_N, 128))
        if DOT:
            part = tl.dot(a.to(xt.dtype, bitcast=True), xt)
            if SCALE:
                s, zs, z = _group_params(scales_ptr, qzeros_ptr, t, offs_n, mask_n, N, True)
                sums = tl.dot(tl.full((BLOCK_N, 128), 1.0, tl.float32).to(xt.dtype), xt)
                acc += part * s[:, None] - sums * (OFFSET * s + zs)[:, None]
            else:
                acc += part
        else:
            folded ^= a
        if not X_ONCE:
            xt = _x_tile(x_ptr, x_ptr, t + 1, offs_kk, offs_m, mask_m, stride_xm, last, K, False, True)
    acc += tl.sum(folded.to(tl.float32), axis=1)[:, None]
    tl.store(out_ptr + pid_k * M * N + offs_m[None, :] * N + offs_n[:, None], acc, mask=mask_m[None, :])


def _us(calls) -> float:
    """Microseconds a call, replayed from one CUDA graph (the weights rotate over copies, so that they come from
    HBM, not L2)."""
    return 1000 * graph_ms(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-json", type=Path, required=True)
    args = parser.parse_args()
    result = {"command": "python " + shlex.join(sys.argv), "commit": current_commit(),
              "device": torch.cuda.get_device_name(), "unit": "int4 GB/s", "stages": "dot, xonce, deq, scale",
              "shapes": {}}
    for name, K, N, block_n, splits in SHAPES:
        copies = [torch.randint(0, 2 ** 31 - 1, (K // 8, N), dtype=torch.int32, device="cuda") for _ in range(4)]
        scales = torch.rand(K // 128, N, device="cuda").half()
        qzeros = torch.randint(0, 2 ** 31 - 1, (K // 128, N // 8), dtype=torch.int32, device="cuda")
        nbytes = copies[0].numel() * 4
        for M in (1, 16):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(splits, M, N, device="cuda", dtype=torch.float32)
            grid = (N // block_n, 1, splits)
            row = {}
            for dot, xonce, deq, scale in STAGES:
                row[f"dot{dot}_xonce{xonce}_deq{deq}_scale{scale}"] = round(nbytes / _us([
                    lambda q=q, f=(dot, xonce, deq, scale): _probe_kernel[grid](
                        x, q, scales, qzeros, out, M, N, K, K, (K // 128) // splits, BLOCK_M=16, BLOCK_N=block_n,
                        MAGIC=0x4300, OFFSET=128.0, DOT=f[0], X_ONCE=f[1], DEQ=f[2], SCALE=f[3], num_warps=4,
                        num_stages=4) for q in copies]) / 1e3)
            config = DecodeConfig(block_n, splits, tile_mma=True, zero_in_regs=False)
            row["library_kernel_ones_mma"] = round(nbytes / _us([
                lambda q=q: w4a16_decode(x, q, scales, qzeros, 128, config=config) for q in copies]) / 1e3)
            print(name, M, row, flush=True)
            result["shapes"][f"{name}_M{M}"] = row
    args.output_json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
