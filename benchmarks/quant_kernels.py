"""Kernel-level microbenchmarks of one linear layer of each shape of a model (qkv, o, gate_up, down,
lm_head): bf16 (``F.linear``, cuBLAS) against the W4A16 layer (its production path: the split-K decode
kernel up to 32 rows), the tiled W4A16 GEMM kernel alone (the previous kernel's algorithm: one ``tl.dot``
per reshaped 128-row tile, split-K partials summed by PyTorch), and the FP8 layer (fused per-token
quantization + ``torch._scaled_mm``).

Each case is first checked against its reference (dequantize then matmul in float32; for FP8 the
float32 emulation of both quantized operands): ``rel_err = max|out - ref| / max|ref|``. Timing replays a
CUDA graph of calls on enough copies of the weights (>= 256 MiB together) that L2 (50 MiB on an H200)
cannot serve them, as in a decode step: no launch overhead, weights streamed from HBM. ``weight_GBps``
is the layer's weight bytes over that time. ``--sweep`` also times the decode kernel under a grid of
``DecodeConfig``s and reports the best per shape and row count, to tune ``decode_config``.

    python benchmarks/quant_kernels.py --model .gpucache/qwen2.5-7b --sweep    # H200 (CUDA only)

``benchmarks/quantization.py`` runs the same microbenchmarks as its first phase.
"""
from __future__ import annotations

import argparse
import itertools
import math
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference.quantization import QuantizationConfig, packing  # noqa: E402
from inference.quantization.fp8 import Fp8LinearMethod  # noqa: E402
from inference.quantization.int4 import Int4LinearMethod  # noqa: E402
from inference.quantization.linear import QuantizedLinear  # noqa: E402

from kernel_timing import ROTATE_BYTES, graph_ms, int4_bytes, rel_err  # noqa: E402

DEVICE = "cuda"
# (block_n, split_k, num_warps) per kernel variant, around the winners of the first sweep (64 columns split 8-16 ways
# for the thin layers, 128 columns split 2-4 ways for gate_up); 256-wide tiles and 2 warps never won.
SWEEP_TILES = ((64, 4, 4), (64, 8, 4), (64, 16, 4), (128, 1, 4), (128, 2, 4), (128, 4, 4), (128, 8, 4),
               (128, 2, 8), (128, 4, 8), (128, 8, 8))
SWEEP_VARIANTS = (False, True)  # tile_mma: eight 16-row chunks per K tile, or one MMA per tile
SWEEP_STAGES = 4


def model_config(model: str):
    """The Hugging Face config of ``model`` (a name or folder; no weights are read)."""
    from inference.model_loader import load_hf_config, resolve_model
    return load_hf_config(resolve_model(model, load_format="dummy").model_dir)


def linear_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """``{name: (in_features K, out_features N)}`` of a Llama/Qwen2-style decoder's linear layers."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    return {"qkv": (hidden, q + 2 * kv), "o": (q, hidden), "gate_up": (hidden, 2 * inter),
            "down": (inter, hidden), "lm_head": (hidden, hf_config.vocab_size)}


def _layers(K: int, N: int, copies: int, device: str):
    """``copies`` independent (bf16 weight [N, K], int4 layer, fp8 layer) triples with random weights."""
    g = torch.Generator(device=device).manual_seed(K * 7 + N)
    out = []
    with torch.device(device):
        for _ in range(copies):
            weight = (torch.randn(N, K, generator=g, device=device) * 0.02).to(torch.bfloat16)
            int4 = QuantizedLinear(K, N, False, Int4LinearMethod(QuantizationConfig("awq", group_size=128)),
                                   torch.bfloat16)
            int4.init_dummy(g)
            with torch.no_grad():  # varied scales and zero points, so a layout mistake shows in rel_err
                int4.scales.uniform_(0.002, 0.006, generator=g)
                int4.qzeros.random_(-2 ** 31, 2 ** 31 - 1, generator=g)
            int4.method.process_weights_after_loading(int4)
            fp8 = QuantizedLinear(K, N, False, Fp8LinearMethod(), torch.bfloat16)
            with torch.no_grad():
                fp8.weight.copy_(weight)
            fp8.method.process_weights_after_loading(fp8)
            out.append((weight, int4, fp8))
    return out


def _fp8_reference(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    from inference.quantization.fp8 import quantize_fp8_rowwise
    codes, scales = quantize_fp8_rowwise(x)
    return (codes.float() * scales) @ (layer.weight.float() * layer.weight_scale[:, None]).t()


def bench_shape(name: str, K: int, N: int, batch_sizes: list[int], sweep: bool, num_sms: int) -> dict:
    """Check and time the four kernels on one linear shape at each row count in ``batch_sizes``."""
    from inference.quantization.triton_w4a16 import w4a16_gemm
    from inference.quantization.triton_w4a16_decode import MAX_DECODE_ROWS, w4a16_decode
    from inference.quantization.triton_w4a16_launch import DecodeConfig

    bf16_bytes = 2 * K * N
    copies = max(2, min(32, math.ceil(ROTATE_BYTES / (K * N // 2))))  # the int4 copies alone overflow L2
    layers = _layers(K, N, copies, DEVICE)
    int4_weight_bytes = int4_bytes(layers[0][1])
    result = {"K": K, "N": N, "weight_copies": copies, "int4_weight_bytes": int4_weight_bytes, "rows": {}}
    for M in batch_sizes:
        x = torch.randn(M, K, device=DEVICE).to(torch.bfloat16)
        weight, int4, fp8 = layers[0]
        dense = int4.method.dequantized_weight(int4, torch.float32)
        kernels = {  # name: (call on one (bf16 weight, int4 layer, fp8 layer) copy, reference, weight bytes)
            "bf16": (lambda w, i, f: F.linear(x, w), x.float() @ weight.float().t(), bf16_bytes),
            "w4a16": (lambda w, i, f: i(x), x.float() @ dense, int4_weight_bytes),
            "w4a16_gemm": (lambda w, i, f: w4a16_gemm(x, i.qweight, i.scales, i.qzeros, 128, num_sms),
                           x.float() @ dense, int4_weight_bytes),
            "fp8": (lambda w, i, f: f(x), _fp8_reference(fp8, x), K * N),
        }
        row = {}
        for kernel, (fn, ref, nbytes) in kernels.items():
            err = rel_err(fn(weight, int4, fp8), ref)
            ms = graph_ms([lambda w=w, i=i, f=f, fn=fn: fn(w, i, f) for w, i, f in layers])
            row[kernel] = {"ms": ms, "weight_GBps": nbytes / ms / 1e6, "rel_err": err, "ok": err < 2e-2}
        row["w4a16_speedup_vs_bf16"] = row["bf16"]["ms"] / row["w4a16"]["ms"]
        if sweep and M <= MAX_DECODE_ROWS:
            row["sweep"] = _sweep(layers, x, x.float() @ dense, DecodeConfig, w4a16_decode)
        result["rows"][str(M)] = row
        print(f"{name:>8} M={M:3d}: " + "  ".join(
            f"{k} {v['ms'] * 1000:7.1f} us ({v['weight_GBps']:5.0f} GB/s{'' if v['ok'] else ' WRONG'})"
            for k, v in row.items() if k != "sweep" and isinstance(v, dict))
            + (f"  best sweep {row['sweep']['best']}" if "sweep" in row else ""), flush=True)
    del layers
    torch.cuda.empty_cache()
    return result


def _sweep(layers, x: torch.Tensor, ref: torch.Tensor, DecodeConfig, w4a16_decode) -> dict:
    """Milliseconds of the decode kernel under each config of the grid (None: its output was wrong)."""
    K = x.shape[1]
    k_tiles = -(-K // packing.PACK_K)
    timings = {}
    for tile_mma, (block_n, split_k, warps) in itertools.product(SWEEP_VARIANTS, SWEEP_TILES):
        if split_k > k_tiles:
            continue
        config = DecodeConfig(block_n=block_n, split_k=split_k, num_warps=warps, num_stages=SWEEP_STAGES,
                              tile_mma=tile_mma)
        calls = [lambda i=i: w4a16_decode(x, i.qweight, i.scales, i.qzeros, 128, counters=i.split_k_counters,
                                          config=config) for _, i, _ in layers]
        name = f"{'tile' if tile_mma else 'chunk'}_n{block_n}_s{split_k}_w{warps}"
        timings[name] = graph_ms(calls) if rel_err(calls[0](), ref) < 2e-2 else None  # a wrong one cannot win
    best = min((name for name, ms in timings.items() if ms is not None), key=timings.get)
    by_variant = {}  # "chunk" / "tile": (best config of that kernel, us)
    for name, ms in timings.items():
        variant = name.split("_n")[0]
        if ms is not None and (variant not in by_variant or ms * 1000 < by_variant[variant][1]):
            by_variant[variant] = (name, round(ms * 1000, 1))
    print(f"    M={x.shape[0]} sweep: {by_variant}", flush=True)
    return {"best": best, "best_ms": timings[best], "best_by_variant": by_variant, "ms": timings}


def run_microbenchmarks(hf_config, batch_sizes: list[int], sweep: bool) -> dict:
    """``{shape name: bench_shape(...)}`` for every linear shape of ``hf_config`` (CUDA only)."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {name: bench_shape(name, K, N, batch_sizes, sweep and name != "lm_head", num_sms)
            for name, (K, N) in linear_shapes(hf_config).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", help="its config gives the shapes; weights are random")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of W4A16 decode-kernel configs")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("the kernel microbenchmarks need a CUDA device")
    from throughput import write_result

    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "device": torch.cuda.get_device_name(), "model": args.model,
              "kernels": run_microbenchmarks(model_config(args.model), args.batch_sizes, args.sweep)}
    write_result(result, args.output_json, f"quant_kernels_{Path(args.model).name}.json")


if __name__ == "__main__":
    main()
