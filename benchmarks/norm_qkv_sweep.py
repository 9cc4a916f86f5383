"""The fused RMSNorm + Q/K/V + rotary + KV-store kernel (``inference/models/triton_norm_qkv.py``) against the
three launches it replaces (the Triton ``fused_add_rms_norm``, cuBLAS ``F.linear``, the Triton rotary kernel
with its cache write), at decode batch sizes, over a grid of its launch configurations.

Timed as ``gemm_sweep.py`` does: CUDA-graph replay over enough weight copies that L2 cannot hold them.

    python benchmarks/norm_qkv_sweep.py --batch-sizes 16 64 128 256 --output-json OUT.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_kernels import ROTATE_BYTES, _graph_ms  # noqa: E402

# (hidden, Hq, Hk, D): Qwen2.5-0.5B (W2) and Qwen2.5-7B (W1, W3)
SHAPES = {"qwen2.5-0.5b": (896, 14, 2, 64), "qwen2.5-7b": (3584, 28, 4, 128)}
GRID = {"block_m": (16, 32, 64), "block_h": (16, 32), "block_k": (128, 256), "num_warps": (4,), "num_stages": (3, 4)}
BLOCK = 16


def bench(name: str, batch: int) -> dict:
    from inference.models import triton_layers
    from inference.models.layers import RotaryEmbedding
    from inference.models.triton_norm_qkv import default_launch, norm_qkv_rope
    hidden_size, hq, hk, d = SHAPES[name]
    dtype, width = torch.bfloat16, (hq + 2 * hk) * d
    copies = max(1, min(64, math.ceil(ROTATE_BYTES / (2 * width * hidden_size))))
    weights = [(torch.randn(width, hidden_size, device="cuda") / hidden_size ** 0.5).to(dtype) for _ in range(copies)]
    bias = (0.1 * torch.randn(width, device="cuda")).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(hidden_size, device="cuda")).to(dtype)
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=1e6), d, 4096).to("cuda")
    rotary.reset_buffers()
    x = torch.randn(batch, hidden_size, device="cuda").to(dtype)
    res = torch.randn(batch, hidden_size, device="cuda").to(dtype)
    pos = torch.randint(0, 4096, (batch,), device="cuda")
    num_blocks = batch // BLOCK + 8
    slots = torch.randperm(num_blocks * BLOCK, device="cuda")[:batch]
    cache_a = torch.zeros(2, num_blocks, BLOCK, hk, d, dtype=dtype, device="cuda")
    cache_b = torch.zeros_like(cache_a)

    def unfused(w):
        normed, _ = triton_layers.fused_add_rms_norm(x, res, norm_w, 1e-6)
        q, k, v = F.linear(normed, w, bias).split([hq * d, hk * d, hk * d], dim=-1)
        q, k = q.view(batch, hq, d), k.view(batch, hk, d)
        triton_layers.rotary_embedding(pos, q, k, rotary.cos, rotary.sin, (v.view(batch, hk, d), cache_a, slots))
        return q

    ref_q = unfused(weights[0]).float()
    row = {"unfused_us": 1e3 * _graph_ms([lambda w=w: unfused(w) for w in weights])}
    configs = []
    for values in itertools.product(*GRID.values()):
        launch = dict(zip(GRID, values))
        if launch["block_m"] > max(16, 1 << (batch - 1).bit_length()):
            continue  # row tiles past the batch only add padding
        try:
            q, _ = norm_qkv_rope(x, res, norm_w, 1e-6, weights[0], bias, pos, rotary.cos, rotary.sin, cache_b,
                                 slots, hq, hk, launch)
            err = ((q.float() - ref_q).abs().max() / ref_q.abs().max()).item()
            us = 1e3 * _graph_ms([lambda w=w, c=launch: norm_qkv_rope(x, res, norm_w, 1e-6, w, bias, pos, rotary.cos,
                                                                      rotary.sin, cache_b, slots, hq, hk, c)
                                  for w in weights])
        except Exception as exc:  # noqa: BLE001 - e.g. shared memory exceeded
            configs.append({**launch, "error": str(exc).splitlines()[0][:160]})
            continue
        configs.append({**launch, "us": us, "rel_err": err, "ok": err < 2e-2})
    timed = sorted((c for c in configs if c.get("ok")), key=lambda c: c["us"])
    default = next((c for c in configs if all(c[k] == v for k, v in default_launch(batch).items())), None)
    row.update(default=default, best=timed[:5], all=configs)
    best = f"best {timed[0]['us']:.1f} us { {k: timed[0][k] for k in GRID} }" if timed else "no config agreed"
    fused = f"{default['us']:.1f} us" if default and "us" in default else "failed"
    print(f"{name} batch {batch}: unfused {row['unfused_us']:.1f} us, fused default {fused}, {best}", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64, 128, 256])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/norm_qkv_sweep.py needs a CUDA device", file=sys.stderr)
        return 2
    started = time.time()
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "device": torch.cuda.get_device_name(), "shapes": {}}
    for name in args.shapes:
        result["shapes"][name] = {"hidden_hq_hk_d": SHAPES[name],
                                  "batches": {str(b): bench(name, b) for b in args.batch_sizes}}
    result["seconds"] = time.time() - started
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
