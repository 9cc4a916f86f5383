"""The W4A16 decode kernel's K split: gate_up and down of the Qwen2.5-7B shape at 1, 16 and 64 rows, each split from 1
to 16 against ``decode_config``'s choice and bf16 cuBLAS, timed as CUDA graphs of 20 calls (median of 5 timings, us a
call). Needs a GPU.

    python benchmarks/w4a16_split_k.py --output-json benchmarks/results/w4a16-split-k_h100_2026-12-07.json
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: inference
import torch  # noqa: E402

from provenance import current_commit  # noqa: E402
from kernel_timing import graph_ms, int4_layer  # noqa: E402

from inference.quantization.triton_w4a16_decode import w4a16_decode  # noqa: E402
from inference.quantization.triton_w4a16_launch import decode_config  # noqa: E402

SHAPES = {"gate_up": (3584, 37888), "down": (18944, 3584)}  # K, N
SPLITS = (1, 2, 3, 4, 6, 8, 16)


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds a call of ``fn``: ``reps`` calls replayed from one CUDA graph (``kernel_timing.graph_ms``)."""
    return 1e3 * graph_ms([fn] * reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-json", default="benchmarks/results/w4a16-split-k.json")
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, (K, N) in SHAPES.items():
        layer = int4_layer(K, N, generator, "cuda")
        w16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        for M in (1, 16, 64):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            default = decode_config(M, N, K, sms)
            configs = {"default": default}
            if not default.gemv:
                configs.update({f"split{s}_st{default.num_stages}": replace(default, split_k=s) for s in SPLITS})
            timings = {}
            for label, config in configs.items():
                timings[label] = round(graph_us(lambda config=config: w4a16_decode(
                    x, layer.qweight, layer.scales, layer.qzeros, layer.group_size,
                    counters=layer.split_k_counters, num_sms=sms, config=config)), 2)
            bf16 = graph_us(lambda: torch.nn.functional.linear(x, w16))
            best_us, best = min((v, k) for k, v in timings.items())
            rows.append({"layer": name, "M": M, "bf16_us": round(bf16, 2), "default": timings["default"],
                         "default_cfg": str(default), "best": best, "best_us": best_us, "all": timings})
            print(f"{name:8s} M={M:3d} bf16 {bf16:7.2f}  default {timings['default']:7.2f}  best {best} {best_us:7.2f}",
                  flush=True)
    out = Path(args.output_json)
    out.parent.mkdir(exist_ok=True, parents=True)
    out.write_text(json.dumps({"command": "python " + shlex.join(sys.argv), "commit": current_commit(),
                               "device": torch.cuda.get_device_name(), "sms": sms, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
