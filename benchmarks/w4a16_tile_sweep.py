"""The W4A16 tile kernel's launch grid at 32-64 rows (batch 32/64 decode steps, the seed's 50 running requests): output
tile width, warps, pipeline stages and K split, on the four linear layers of the
Qwen2.5-7B shape, against ``decode_config``'s choice and bf16 cuBLAS. Each config is timed as a CUDA graph of calls
that cycle through enough copies of the layer to exceed the L2 cache (median of 5 timings, us a call), and its
output is checked against the default config's. Needs a GPU.

    python benchmarks/w4a16_tile_sweep.py --output-json benchmarks/results/w4a16-tile-sweep_h100_2026-12-07.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: inference
import torch  # noqa: E402

from provenance import current_commit  # noqa: E402
from kernel_timing import calls_ms, int4_layer  # noqa: E402

from inference.quantization.triton_w4a16_decode import w4a16_decode  # noqa: E402
from inference.quantization.triton_w4a16_launch import decode_config  # noqa: E402

SHAPES = {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)}  # K, N
L2_BYTES = 160 * 2**20  # the copies of a layer that one graph cycles through hold at least this much int4 weight
GRID = {"block_n": (64, 128, 256), "num_warps": (4, 8), "num_stages": (3, 4), "split_k": (1, 2, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--layers", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--shapes", type=int, nargs=2, default=None, metavar=("K", "N"),
                        help="one layer of this shape instead (CPU smoke runs under TRITON_INTERPRET=1)")
    parser.add_argument("--output-json", default="benchmarks/results/w4a16-tile-sweep.json")
    for key, values in GRID.items():
        parser.add_argument("--" + key.replace("_", "-"), type=int, nargs="+", default=list(values),
                            help=f"values swept (default {' '.join(map(str, values))}; 2 warps run mma.sync, not wgmma)")
    args = parser.parse_args()
    grid = {key: tuple(getattr(args, key)) for key in GRID}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = {"custom": tuple(args.shapes)} if args.shapes else {name: SHAPES[name] for name in args.layers}
    generator = torch.Generator(device=device).manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    rows = []
    for name, (K, N) in shapes.items():
        copies = max(1, -(-L2_BYTES // (K * N // 2))) if device == "cuda" else 1
        layers = [int4_layer(K, N, generator, device) for _ in range(copies)]
        w16 = [torch.randn(N, K, device=device, dtype=torch.bfloat16) for _ in range(max(1, copies // 4))]
        for M in args.rows:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            default = decode_config(M, N, K, sms)

            def run(config, layer):
                return w4a16_decode(x, layer.qweight, layer.scales, layer.qzeros, layer.group_size,
                                    counters=layer.split_k_counters, num_sms=sms, config=config)
            reference = run(default, layers[0]).float()
            timings, errors = {}, {}
            configs = {"default": default}
            for values in itertools.product(*grid.values()):
                config = replace(default, **dict(zip(grid, values)))
                configs["bn{}_w{}_st{}_sk{}".format(*values)] = config
            for label, config in configs.items():
                try:
                    err = ((run(config, layers[0]).float() - reference).abs().max() /
                           reference.abs().max()).item()
                    if err > 1e-2:
                        errors[label] = f"max relative error {err:.3g}"
                        continue
                    timings[label] = round(1e3 * calls_ms([lambda c=config, layer=layer: run(c, layer)
                                                          for layer in layers], device), 2)
                except Exception as exc:  # a config the compiler or the GPU cannot run (registers, shared memory)
                    errors[label] = f"{type(exc).__name__}: {str(exc)[:160]}"
            bf16 = 1e3 * calls_ms([lambda w=w: torch.nn.functional.linear(x, w) for w in w16], device)
            best_us, best = min((v, k) for k, v in timings.items())
            top = sorted(timings.items(), key=lambda kv: kv[1])[:8]
            rows.append({"layer": name, "M": M, "K": K, "N": N, "copies": copies, "bf16_us": round(bf16, 2),
                         "default_us": timings.get("default"), "default_cfg": str(default), "best": best,
                         "best_us": best_us, "top8": dict(top), "all": timings, "failed": errors})
            int4_gbps = K * N / 2 / (best_us * 1e-6) / 1e9
            print(f"{name:8s} M={M:3d} bf16 {bf16:7.2f}  default {timings.get('default')}  best {best} {best_us:7.2f} us "
                  f"({int4_gbps:,.0f} GB/s int4); {len(errors)} configs failed", flush=True)
            print("   top: " + ", ".join(f"{k} {v}" for k, v in top[1:6]), flush=True)
        del layers, w16
        if device == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.output_json)
    out.parent.mkdir(exist_ok=True, parents=True)
    out.write_text(json.dumps({"command": "python " + shlex.join(sys.argv), "commit": current_commit(),
                               "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "sms": sms, "grid": grid, "rows": rows},
                              indent=1))


if __name__ == "__main__":
    main()
