"""Which operand order makes ``torch._scaled_mm`` (cuBLASLt FP8, row-wise scales) fastest for each linear
shape and row count: the engine's ``x_fp8 [T, K] @ W^T`` against the swapped ``W [N, K] @ x_fp8^T``, whose
output ``[N, T]`` is transposed back (timed as a view, and with the copy that makes it row-major), and
against split-K (``torch._scaled_grouped_mm`` over 2, 4 or 8 slices of K, partials summed), beside bf16
``F.linear`` (cuBLAS). Decode at batch 256 put FP8's GEMMs at about 2 TB/s of weights against bf16's
2.8 TB/s (``w1-bf16-fp8-kernel-profile_h200_2026-11-30.json``); with T the short side, the swapped order puts
the token dimension in cuBLAS's N tile, so that one tile column may read each weight once.

With ``--triton-sweep``, up to 256 rows, also the Triton FP8 GEMM (``triton_fp8_gemm``) over a grid of
tiles and K splits (``triton_bm{M}_bn{N}_sk{S}``; the best one printed per row count).

Each case is checked against the float32 emulation of both quantized operands (``rel_err``), and timed
as ``quant_kernels.py`` does (``kernel_timing.graph_ms``): CUDA graph replay over enough weight copies
that L2 cannot hold them.
The per-token activation quantization is done once, outside the timing (the same for both orders).

    python benchmarks/fp8_gemm_layouts.py --model .gpucache/qwen2.5-7b --output-json OUT.json  # H200
    python benchmarks/fp8_gemm_layouts.py --model .gpucache/qwen2.5-7b --triton-sweep --batch-sizes 16 64 128 256 \
        --no-layouts --output-json OUT.json
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_timing import ROTATE_BYTES, graph_ms, rel_err  # noqa: E402
from quant_kernels import linear_shapes, model_config  # noqa: E402

from inference.quantization.fp8 import quantize_fp8_rowwise  # noqa: E402


def _orders(xq, xs):
    """``{name: call(weight codes [N, K], weight scales [N]) -> [T, N]}`` for the two operand orders."""
    def engine(w, ws):
        return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)

    def swapped(w, ws):
        return torch._scaled_mm(w, xq.t(), scale_a=ws.view(-1, 1), scale_b=xs.view(1, -1),
                                out_dtype=torch.bfloat16).t()

    def split_k(splits):
        # K cut into `splits` slices, one batch entry each of torch._scaled_grouped_mm (3D x 3D, row-wise
        # scales per entry), partial products summed: more CTAs for the thin layers (N = hidden size).
        T, K = xq.shape

        def call(w, ws):
            a = xq.view(T, splits, K // splits).transpose(0, 1)                         # [S, T, K/S] row-major
            b = w.view(w.shape[0], splits, K // splits).permute(1, 2, 0)                # [S, K/S, N] col-major
            return torch._scaled_grouped_mm(a, b, xs.view(1, T).expand(splits, T),
                                            ws.view(1, -1).expand(splits, -1), out_dtype=torch.bfloat16).sum(0)
        return call

    return {"fp8": engine, "fp8_swapped_view": swapped, "fp8_swapped_copy": lambda w, ws: swapped(w, ws).contiguous(),
            **{f"fp8_splitk{n}": split_k(n) for n in (2, 4, 8)}}


def _triton_configs(T: int, wide: bool = False) -> dict:
    """``{name: Fp8GemmConfig}``: the sweep's grid for ``T`` rows (none above 256). ``wide``: from 129 rows,
    also 256-row and 256-column tiles and 3 or 4 pipeline stages, whole K or split 2 ways."""
    from inference.quantization.triton_fp8_gemm import Fp8GemmConfig
    if T > 256:
        return {}
    if wide and T > 128:
        return {f"triton_bm{bm}_bn{bn}_sk{sk}_st{st}": Fp8GemmConfig(bm, bn, sk, num_warps=8, num_stages=st)
                for bm in (128, 256) for bn in (64, 128, 256) if bm * bn <= 128 * 256
                for sk in (1, 2) for st in (3, 4)}
    block_ms = [16] if T <= 16 else [64] if T <= 64 else [64, 128]
    return {f"triton_bm{bm}_bn{bn}_sk{sk}": Fp8GemmConfig(bm, bn, sk, num_warps=8 if bm == 128 else 4)
            for bm in block_ms for bn in (64, 128) for sk in (1, 2, 4, 8)}


def _triton_calls(xq, xs, N: int, configs: dict) -> dict:
    """``{name: call(weight codes, weight scales) -> [T, N]}`` of the Triton FP8 GEMM, one per config."""
    from inference.quantization.triton_fp8_gemm import fp8_gemm
    counters = torch.zeros(4096 + N, dtype=torch.int32, device="cuda")  # shared: each call leaves them zero
    return {name: (lambda w, ws, c=c: fp8_gemm(xq, xs, w, ws, c, counters=counters)) for name, c in configs.items()}


def bench_shape(name: str, K: int, N: int, batch_sizes: list[int], layouts: bool = True,
                triton_sweep: bool = False, wide: bool = False) -> dict:
    """Check and time bf16 and the FP8 variants on one linear shape at each row count."""
    copies = max(1, min(32, math.ceil(ROTATE_BYTES / (K * N))))
    g = torch.Generator(device="cuda").manual_seed(K * 7 + N)
    weights = [(torch.randn(N, K, generator=g, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(copies)]
    fp8 = [quantize_fp8_rowwise(w) for w in weights]  # (codes [N, K], scales [N, 1]) per copy
    result = {"K": K, "N": N, "weight_copies": copies, "rows": {}}
    for T in batch_sizes:
        x = torch.randn(T, K, device="cuda").to(torch.bfloat16)
        xq, xs = quantize_fp8_rowwise(x)
        ref = (xq.float() * xs) @ (fp8[0][0].float() * fp8[0][1]).t()
        row = {"bf16": {"ms": graph_ms([lambda w=w: F.linear(x, w) for w in weights])}}
        row["bf16"]["weight_GBps"] = 2 * K * N / row["bf16"]["ms"] / 1e6
        calls = _orders(xq, xs) if layouts else {"fp8": _orders(xq, xs)["fp8"]}
        if triton_sweep:
            calls.update(_triton_calls(xq, xs, N, _triton_configs(T, wide)))
        for kernel, fn in calls.items():
            try:
                err = rel_err(fn(fp8[0][0], fp8[0][1].view(-1)), ref)
                ms = graph_ms([lambda c=c, s=s, fn=fn: fn(c, s.view(-1)) for c, s in fp8])
            except Exception as exc:  # noqa: BLE001 - e.g. a row count cuBLASLt refuses, a tile over shared memory
                row[kernel] = {"error": str(exc).splitlines()[0][:200]}
                continue
            row[kernel] = {"ms": ms, "weight_GBps": K * N / ms / 1e6, "rel_err": err, "ok": err < 2e-2}
        result["rows"][str(T)] = row
        shown = {k: v for k, v in row.items() if not k.startswith("triton_")}
        tried = {k: v for k, v in row.items() if k.startswith("triton_") and v.get("ok")}
        if tried:
            best = min(tried, key=lambda k: tried[k]["ms"])
            shown[best] = tried[best]
        print(f"{name:>8} T={T:5d}: " + "  ".join(
            f"{k} {v['ms'] * 1000:8.1f} us ({v['weight_GBps']:5.0f} GB/s{'' if v.get('ok', True) else ' WRONG'})"
            if "ms" in v else f"{k} error" for k, v in shown.items()), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", help="its config gives the shapes; weights are random")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[16, 64, 128, 256, 512, 2048])
    parser.add_argument("--triton-sweep", action="store_true", help="also the Triton FP8 GEMM's configs")
    parser.add_argument("--wide-grid", action="store_true", help="the larger tiles' grid from 129 rows")
    parser.add_argument("--no-layouts", action="store_true", help="skip the swapped and split-K cuBLASLt variants")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("the FP8 GEMM benchmark needs a CUDA device")
    from throughput import write_result

    shapes = {k: v for k, v in linear_shapes(model_config(args.model)).items() if k != "lm_head"}
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "device": torch.cuda.get_device_name(0), "model": args.model,
              "shapes": {name: bench_shape(name, K, N, args.batch_sizes, not args.no_layouts, args.triton_sweep,
                                                     args.wide_grid)
                         for name, (K, N) in shapes.items()}}
    write_result(result, args.output_json, "fp8_gemm_layouts.json")


if __name__ == "__main__":
    main()
