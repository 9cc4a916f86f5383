"""16-bit decode GEMMs: cuBLAS (``F.linear``) against the Triton split-K GEMM over a grid of tiles, and
(``--blas-libraries``) the same ``F.linear`` through torch's other BLAS front end (cuBLASLt).

At Qwen2.5-0.5B's hidden size (896) a decode step's products are a few microseconds each, and cuBLAS's
128-wide output tiles leave most of the H200's 132 SMs idle on the thin layers (qkv 1,152 outputs, o and
down 896). ``triton_fp8_gemm.splitk_gemm`` runs the FP8 GEMM's tiles and K split on bf16 operands. Each
case is checked against the float32 product (``rel_err``) and timed as ``quant_kernels.py`` does
(``kernel_timing.graph_ms``): CUDA graph replay over enough weight copies that L2 cannot hold them (a decode
step reads each weight once).

    python benchmarks/gemm_sweep.py --model .gpucache/qwen2.5-0.5b --batch-sizes 64 128 256 --output-json OUT.json
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


def _configs(T: int) -> dict:
    """``{name: Fp8GemmConfig}``: row tile covering ``T`` (at most 128), 32-128 columns, K split 1-4."""
    from inference.quantization.triton_fp8_gemm import Fp8GemmConfig
    cover = min(max(16, 1 << (T - 1).bit_length()), 128)
    block_ms = sorted({cover, 64} if T > 64 else {cover})
    return {f"triton_bm{bm}_bn{bn}_bk{bk}_sk{sk}_w{w}": Fp8GemmConfig(bm, bn, sk, num_warps=w, num_stages=4, block_k=bk)
            for bm in block_ms for bn in (32, 64, 128) for bk in (64, 128) for sk in (1, 2, 4)
            for w in ((4, 8) if bm * bn >= 128 * 64 else (4,))}


def bench_shape(name: str, K: int, N: int, batch_sizes: list[int], blas_libraries=(), triton_grid: bool = True) -> dict:
    from inference.quantization.triton_fp8_gemm import splitk_gemm
    copies = max(1, min(64, math.ceil(ROTATE_BYTES / (2 * K * N))))
    g = torch.Generator(device="cuda").manual_seed(K * 7 + N)
    weights = [(torch.randn(N, K, generator=g, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(copies)]
    counters = torch.zeros(4096 + N, dtype=torch.int32, device="cuda")
    result = {"K": K, "N": N, "weight_copies": copies, "rows": {}}
    for T in batch_sizes:
        x = torch.randn(T, K, device="cuda").to(torch.bfloat16)
        ref = x.float() @ weights[0].float().t()
        ms = graph_ms([lambda w=w: F.linear(x, w) for w in weights])
        row = {"cublas": {"ms": ms, "weight_GBps": 2 * K * N / ms / 1e6}}
        default_library = torch.backends.cuda.preferred_blas_library()
        for library in blas_libraries:  # the same F.linear through another BLAS front end
            torch.backends.cuda.preferred_blas_library(library)
            try:
                ms = graph_ms([lambda w=w: F.linear(x, w) for w in weights])
                row[f"blas_{library}"] = {"ms": ms, "weight_GBps": 2 * K * N / ms / 1e6}
            finally:
                torch.backends.cuda.preferred_blas_library(default_library)
        for kname, config in (_configs(T) if triton_grid else {}).items():
            try:
                err = rel_err(splitk_gemm(x, weights[0], config, counters=counters), ref)
                ms = graph_ms([lambda w=w, c=config: splitk_gemm(x, w, c, counters=counters) for w in weights])
            except Exception as exc:  # noqa: BLE001 - e.g. a tile over shared memory
                row[kname] = {"error": str(exc).splitlines()[0][:200]}
                continue
            row[kname] = {"ms": ms, "weight_GBps": 2 * K * N / ms / 1e6, "rel_err": err, "ok": err < 2e-2}
        tried = {k: v for k, v in row.items() if k.startswith("triton_") and v.get("ok")}
        best = min(tried, key=lambda k: tried[k]["ms"]) if tried else None
        row["best_triton"] = best
        result["rows"][str(T)] = row
        others = "".join(f" {k} {v['ms'] * 1000:.1f} us" for k, v in row.items() if k.startswith("blas_"))
        print(f"{name:>8} T={T:4d}: cublas {row['cublas']['ms'] * 1000:7.1f} us{others} "
              f"({row['cublas']['weight_GBps']:5.0f} GB/s)  best {best} "
              f"{tried[best]['ms'] * 1000 if best else float('nan'):7.1f} us", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b", help="its config gives the shapes; weights are random")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--blas-libraries", nargs="*", default=[], choices=["cublaslt"],
                        help="also time F.linear with torch.backends.cuda.preferred_blas_library set to each")
    parser.add_argument("--no-triton", action="store_true", help="skip the Triton split-K grid")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("the GEMM sweep needs a CUDA device")
    from throughput import write_result

    shapes = linear_shapes(model_config(args.model))
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "device": torch.cuda.get_device_name(0), "model": args.model,
              "shapes": {name: bench_shape(name, K, N, args.batch_sizes, args.blas_libraries, not args.no_triton)
                         for name, (K, N) in shapes.items()}}
    write_result(result, args.output_json, "gemm_sweep.json")


if __name__ == "__main__":
    main()
