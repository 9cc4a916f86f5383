"""W4A16 paths against bf16 cuBLAS on the Qwen2.5-7B linear shapes (qkv, o, gate_up, down), in one run:

1. checks: the production dispatch (``w4a16_matmul``: decode kernel, GEMM kernel or dequantize + cuBLAS by
   row count), each path alone, and a GPTQ act-order layer, against dequantize-then-matmul in float32, in
   float16 and bfloat16 (``rel_err = max|out - ref| / max|ref|``, ok below 2e-2);
2. timings at M = 1, 2, 4, 8, 16, 32, 64, 256, 2048 rows (bf16): ``F.linear`` on bf16 weights, the previous
   production path (``old``: the decode kernel with its all-ones MMA and 64-column tiles up to 32 rows, the
   GEMM kernel above), the new dispatch (``new``), and each path alone where it applies (``decode``, ``gemv``
   (the CUDA-core kernel, up to 4 rows), ``gemm``, ``dequant``); ``int4_GBps`` is the int4 weights' bytes
   (codes, scales, zero points) over the time, ``speedup_vs_bf16`` bf16's time over the path's;
3. decode-kernel configs around ``decode_config`` at ``SWEEP_ROWS`` (the split halved and doubled, the
   loop variants, the GEMV kernel's tile widths up to 4 rows), while ``--budget-s`` lasts.

Shapes go one at a time, checks then timings, the largest first. About 100 kernel specializations compile
on the way (a few minutes on a fresh machine with the decode-config sweep, which ``--budget-s`` cuts short).

Timing replays one CUDA graph of calls over enough copies of the weights (>= 256 MiB) that L2 cannot serve
them, as in a decode step (quant_kernels.py's method, ``kernel_timing.calls_ms``). A failing case is recorded with
its error and skipped; the JSON is rewritten after every shape, so a run cut short keeps what it measured.

    python benchmarks/w4a16_sweep.py --output-json /tmp/out/w4a16-sweep_h200_DATE.json     # GPU
    python benchmarks/w4a16_sweep.py --smoke       # CPU, Triton's interpreter, tiny shapes: the script runs
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.inference.triton_interpreter import fix_interpreter  # noqa: E402
    fix_interpreter()

from kernel_timing import GROUP, ROTATE_BYTES, calls_ms, int4_bytes, int4_layer, rel_err  # noqa: E402

# Qwen2.5-7B: hidden 3584, intermediate 18944, 28 query heads and 4 KV heads of 128
# (K, N), the largest first: a run cut short keeps the shapes that weigh most in a decode step
SHAPES = {"gate_up": (3584, 37888), "down": (18944, 3584), "qkv": (3584, 4608), "o": (3584, 3584)}
SMOKE_SHAPES = {"qkv": (256, 192), "down": (384, 128)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 256, 2048)
SMOKE_ROWS = (1, 16, 64, 130)
SWEEP_ROWS = (1, 2, 4, 8, 16, 32, 64)  # at 2 and 4 rows only the default and the GEMV kernel's configs
CHECK_ROWS = (1, 16, 64, 256)  # the decode kernel's 16- and 64-row blocks, the GEMM and dequantize paths


def _previous_decode_config(M: int, N: int, K: int, num_sms: int):
    """The decode kernel's config before the 2026-12-06 sweep (commit 02d6ef1): ``tile_config``'s split, up to 16
    rows the zero point taken off after the MMA with the x tile's sums and 64-column tiles (128 for N >= 16384),
    above 16 rows the zero point in registers; x tiles loaded ahead into registers; no GEMV kernel."""
    from inference.quantization.triton_w4a16_launch import tile_config
    small = M <= 16
    return replace(tile_config(M, N, K, num_sms), block_n=64 if small and N < 16384 else 128, zero_in_regs=not small,
                   x_sums=small, x_in_loop=False)


def _paths(M: int, N: int, K: int, num_sms: int) -> dict:
    """``{name: call(x, layer)}`` of the W4A16 paths that apply at ``M`` rows."""
    from inference.quantization.triton_w4a16 import w4a16_gemm, w4a16_matmul
    from inference.quantization.triton_w4a16_dequant import dequant_matmul
    from inference.quantization.triton_w4a16_decode import MAX_DECODE_ROWS, w4a16_decode
    from inference.quantization.triton_w4a16_gemv import MAX_GEMV_ROWS
    from inference.quantization.triton_w4a16_launch import decode_config, gemv_config

    def args(i):
        return i.qweight, i.scales, i.qzeros, i.group_size

    paths = {"new": lambda x, i: w4a16_matmul(x, *args(i), perm=i.perm, counters=i.split_k_counters,
                                              num_sms=num_sms)}
    if M <= 32:
        old = _previous_decode_config(M, N, K, num_sms)
        paths["old"] = lambda x, i: w4a16_decode(x, *args(i), counters=i.split_k_counters, config=old)
    else:
        paths["old"] = lambda x, i: w4a16_gemm(x, *args(i), num_sms)
    if M <= MAX_DECODE_ROWS:
        paths["decode"] = lambda x, i: w4a16_decode(x, *args(i), counters=i.split_k_counters, num_sms=num_sms)
    if M <= MAX_GEMV_ROWS:
        gemv = gemv_config(M, N, K, num_sms)
        paths["gemv"] = lambda x, i: w4a16_decode(x, *args(i), counters=i.split_k_counters, config=gemv)
    if 32 <= M <= 256:
        paths["gemm"] = lambda x, i: w4a16_gemm(x, *args(i), num_sms)
    if M >= 64:
        paths["dequant"] = lambda x, i: dequant_matmul(x, *args(i))
    return paths


def _guarded(record: dict, key: str, fn) -> None:
    """``record[key] = fn()``, or the error's last line (printed in full) if it raises."""
    try:
        record[key] = fn()
    except Exception as exc:  # one bad config or path must not end the sweep
        traceback.print_exc()
        record[key] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}


def check_shape(K: int, N: int, rows, device: str, num_sms: int) -> dict:
    """Every path against dequantize-then-matmul in float32, in float16 and bfloat16; a GPTQ act-order layer in
    bfloat16."""
    g = torch.Generator(device=device).manual_seed(K + N)
    layer = int4_layer(K, N, g, device)
    act_order = int4_layer(K, N, g, device, desc_act=True)
    dense = layer.method.dequantized_weight(layer, torch.float32)
    dense_act = act_order.method.dequantized_weight(act_order, torch.float32)
    result = {}
    for dtype in (torch.float16, torch.bfloat16):
        for M in rows:
            x = torch.randn(M, K, device=device, generator=g).to(dtype)
            ref = x.float() @ dense
            entry = result.setdefault(f"{str(dtype).split('.')[-1]}_M{M}", {})
            for name, fn in _paths(M, N, K, num_sms).items():
                _guarded(entry, name, lambda fn=fn: rel_err(fn(x, layer), ref))
            if dtype == torch.bfloat16:  # act-order's column gather: one dtype is enough
                x_act = x.index_select(1, act_order.perm)
                _guarded(entry, "new_gptq_act_order", lambda: rel_err(
                    _paths(M, N, K, num_sms)["new"](x, act_order), x_act.float() @ dense_act))
    bad = [f"{case}:{path}" for case, entry in result.items() for path, err in entry.items()
           if not isinstance(err, float) or err >= 2e-2]
    print(f"  checks: {len(result)} cases, {'all ok' if not bad else 'FAILED ' + ', '.join(bad)}", flush=True)
    return {"rel_err": result, "failed": bad}


def time_shape(name: str, K: int, N: int, rows, device: str, num_sms: int, deadline: float) -> dict:
    """bf16 and the W4A16 paths at each row count; decode-kernel configs at ``SWEEP_ROWS`` before ``deadline``."""
    g = torch.Generator(device=device).manual_seed(K * 7 + N)
    copies = max(2, min(32, math.ceil(ROTATE_BYTES / (K * N // 2)))) if device == "cuda" else 2
    layers = [int4_layer(K, N, g, device) for _ in range(copies)]
    bf16_copies = max(2, min(copies, math.ceil(ROTATE_BYTES / (2 * K * N)))) if device == "cuda" else 2
    weights = [(torch.randn(N, K, device=device, generator=g) * 0.02).to(torch.bfloat16) for _ in range(bf16_copies)]
    int4_weight_bytes = int4_bytes(layers[0])
    result = {"K": K, "N": N, "int4_weight_bytes": int4_weight_bytes, "bf16_weight_bytes": 2 * K * N,
              "int4_copies": copies, "bf16_copies": bf16_copies, "rows": {}}
    for M in rows:
        x = torch.randn(M, K, device=device, generator=g).to(torch.bfloat16)
        row = result["rows"][str(M)] = {}
        _guarded(row, "bf16", lambda: {"ms": calls_ms([lambda w=w: F.linear(x, w) for w in weights], device)})
        for path, fn in _paths(M, N, K, num_sms).items():
            _guarded(row, path, lambda fn=fn: {"ms": calls_ms([lambda i=i: fn(x, i) for i in layers], device)})
        base = row["bf16"].get("ms")
        for path, entry in row.items():
            if "ms" in entry:
                entry["int4_GBps"] = int4_weight_bytes / entry["ms"] / 1e6
                if base:
                    entry["speedup_vs_bf16"] = base / entry["ms"]
        if M in SWEEP_ROWS and time.monotonic() < deadline:
            row["decode_configs"] = _sweep_decode(x, layers, M, N, K, num_sms, device, int4_weight_bytes)
        print(f"{name:>8} M={M:5d}: " + "  ".join(
            f"{p} {e['ms'] * 1000:8.1f} us ({e['int4_GBps']:5.0f} GB/s int4, {e.get('speedup_vs_bf16', 0):.2f}x)"
            if "ms" in e and p != "bf16" else f"{p} {e['ms'] * 1000:8.1f} us" if "ms" in e else f"{p} ERROR"
            for p, e in row.items() if p != "decode_configs"), flush=True)
    return result


def _sweep_decode(x, layers, M: int, N: int, K: int, num_sms: int, device: str, int4_bytes: int) -> dict:
    """Microseconds and int4 GB/s of the decode kernel under configs around ``decode_config``."""
    from inference.quantization.triton_w4a16_decode import w4a16_decode
    from inference.quantization.triton_w4a16_gemv import MAX_GEMV_ROWS
    from inference.quantization.triton_w4a16_launch import decode_config, gemv_config, tile_config
    base = tile_config(M, N, K, num_sms)  # the tile kernel's variants around decode_config's choice for it
    configs = {"default": decode_config(M, N, K, num_sms), "tile": base,
               "split_x2": replace(base, split_k=base.split_k * 2),
               "split_half": replace(base, split_k=max(1, base.split_k // 2)),
               "ones_mma": replace(base, zero_in_regs=False, x_sums=False),
               "x_sums": replace(base, zero_in_regs=False, x_sums=True),
               "n64": replace(base, block_n=64),
               "no_prefetch": replace(base, prefetch=False),
               "x_ahead": replace(base, x_in_loop=False),
               "x_ahead_x_sums": replace(base, x_in_loop=False, zero_in_regs=False, x_sums=True),
               "x_ahead_ones_mma": replace(base, x_in_loop=False, zero_in_regs=False, x_sums=False)}
    if M <= MAX_GEMV_ROWS:  # the CUDA-core kernel: output tile width, warps, the next tile's loads ahead or not
        gemv = gemv_config(M, N, K, num_sms)
        if M > 1:  # the tile kernel's variants are swept at 1 row and from 8
            configs = {"default": configs["default"]}
        configs |= {"gemv": gemv, "gemv_no_prefetch": replace(gemv, prefetch=False),
                    "gemv_n64": replace(gemv, block_n=64), "gemv_n256_w8": replace(gemv, block_n=256, num_warps=8),
                    "gemv_n256_w4": replace(gemv, block_n=256),
                    "gemv_split_x2": replace(gemv, split_k=gemv.split_k * 2),
                    "gemv_split_x4": replace(gemv, split_k=gemv.split_k * 4),
                    "gemv_no_prefetch_split_x2": replace(gemv, prefetch=False, split_k=gemv.split_k * 2),
                    "gemv_split_half": replace(gemv, split_k=max(1, gemv.split_k // 2))}
    out = {}
    for label, config in configs.items():
        key = f"{label}_n{config.block_n}_s{config.split_k}_w{config.num_warps}"
        _guarded(out, key, lambda config=config: {"ms": calls_ms(
            [lambda i=i: w4a16_decode(x, i.qweight, i.scales, i.qzeros, i.group_size, counters=i.split_k_counters,
                                      config=config) for i in layers], device)})
        if "ms" in out[key]:
            out[key]["int4_GBps"] = int4_bytes / out[key]["ms"] / 1e6
    timed = {k: v["ms"] for k, v in out.items() if "ms" in v}
    if timed:
        best = min(timed, key=timed.get)
        print(f"    M={M} decode configs: best {best} {timed[best] * 1000:.1f} us; default "
              f"{next((v * 1000 for k, v in timed.items() if k.startswith('default')), float('nan')):.1f} us",
              flush=True)
    return out


def summary(result: dict) -> list[str]:
    """The int4 GB/s at batch 1 and the speed-ups of the new path over bf16 and over the old one."""
    lines = []
    for shape, entry in result["timings"].items():
        for M, row in entry.get("rows", {}).items():
            new, old, bf16 = row.get("new", {}), row.get("old", {}), row.get("bf16", {})
            if "ms" in new and "ms" in bf16:
                lines.append(f"{shape:>8} M={M:>5}: new {new['speedup_vs_bf16']:.2f}x bf16 ({new['int4_GBps']:.0f} "
                             f"GB/s int4)" + (f", old {old['speedup_vs_bf16']:.2f}x" if "ms" in old else ""))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=None, help=f"row counts to time (default {ROWS})")
    parser.add_argument("--shapes", nargs="+", default=None, choices=sorted(SHAPES))
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="no new decode-config sweeps after this many seconds (checks and main timings go on)")
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    start = time.monotonic()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --smoke)")
    shapes = SMOKE_SHAPES if args.smoke else {k: SHAPES[k] for k in (args.shapes or SHAPES)}
    rows = args.rows or (SMOKE_ROWS if args.smoke else ROWS)
    check_rows = SMOKE_ROWS if args.smoke else CHECK_ROWS
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 8
    from inference.quantization.triton_w4a16 import DEQUANT_MIN_ROWS
    from inference.quantization.triton_w4a16_decode import MAX_DECODE_ROWS
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
              "torch": torch.__version__, "max_decode_rows": MAX_DECODE_ROWS, "dequant_min_rows": DEQUANT_MIN_ROWS,
              "group_size": GROUP, "checks": {}, "timings": {}}
    path = Path(args.output_json) if args.output_json else None

    def save() -> None:
        if path:
            path.write_text(json.dumps(result, indent=1) + "\n")

    for name, (K, N) in shapes.items():
        print(f"== {name}: K={K} N={N} ({time.monotonic() - start:.0f} s)", flush=True)
        _guarded(result["checks"], name, lambda: check_shape(K, N, check_rows, device, num_sms))
        save()
        _guarded(result["timings"], name, lambda: time_shape(name, K, N, rows, device, num_sms,
                                                             start + args.budget_s))
        save()
        if device == "cuda":
            torch.cuda.empty_cache()
    result["seconds"] = time.monotonic() - start
    save()
    print("\n".join(["== summary =="] + summary(result)))
    print(f"wrote {path}" if path else "(no --output-json)")
    if any(entry.get("failed", True) for entry in result["checks"].values() if isinstance(entry, dict)):
        sys.exit(1)


if __name__ == "__main__":
    main()
