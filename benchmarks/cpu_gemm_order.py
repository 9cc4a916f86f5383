"""The CPU's dense linear layers: ``W @ x^T`` (the default up to ``CPU_WEIGHT_LEFT_MAX_ROWS`` rows) against
``x @ W^T`` (``torch.nn.functional.linear``), side by side.

Two parts, alternating the two operand orders in one process:
  1. the GEMMs of one SmolLM2 decode step alone (30 layers of qkv, o, gate_up, down, and the 49,152-row LM head)
     at 1-2,048 rows, both orders at every row count (the best of the rounds);
  2. the packaged SmolLM2 engine (``LLM.generate``) on 1, 4, 16 and 64 streams of 64-token prompts decoding 64
     greedy tokens each, with ``x @ W^T`` forced in for the "x_left" arm; the tokens of both arms are compared.

    python benchmarks/cpu_gemm_order.py --output-json benchmarks/results/cpu-gemm-order_cpu_<date>.json
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from provenance import current_commit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import LLM, SamplingParams  # noqa: E402
from inference.models import parallel_layers  # noqa: E402

# SmolLM2-135M: (in, out, layers) of qkv, o, gate_up, down, and the tied LM head
SHAPES = [(576, 960, 30), (576, 576, 30), (576, 3072, 30), (1536, 576, 30), (576, 49_152, 1)]
ORDERS = ("weight_left", "x_left")


def product(order: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w^T`` computed in ``order`` (``weight_left``: ``(w @ x^T)^T`` copied into place, as ``linear`` does)."""
    if order == "weight_left":
        return torch.mm(w, x.t()).t().contiguous()
    return torch.nn.functional.linear(x, w)


def step_gemms_ms(order: str, xs: list[torch.Tensor], weights: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for (_, _, layers), x, w in zip(SHAPES, xs, weights):
        for _ in range(layers if x.shape[0] < 512 else 2):
            product(order, x, w)
    return (time.perf_counter() - start) * 1e3


def gemms_alone(rows_list: list[int], rounds: int) -> dict:
    """Both operand orders at every row count (also those where ``linear`` keeps one of them)."""
    weights = [torch.randn(n, k) for k, n, _ in SHAPES]
    out = {}
    for rows in rows_list:
        xs = [torch.randn(rows, k) for k, _, _ in SHAPES]
        times = {name: [] for name in ORDERS}
        for _ in range(rounds):
            for name in ORDERS:
                times[name].append(step_gemms_ms(name, xs, weights))
        best = {name: min(v) for name, v in times.items()}
        out[str(rows)] = {"ms_best": best, "ms_rounds": times,
                          "x_left_over_weight_left": best["x_left"] / best["weight_left"]}
        print(f"{rows:5d} rows: W @ x^T {best['weight_left']:.1f} ms, x @ W^T {best['x_left']:.1f} ms "
              f"({'the layers' if rows < 512 else 'two of each layer'})", flush=True)
    return out


def engine_rounds(streams_list: list[int], rounds: int, input_len: int, output_len: int, default: int) -> dict:
    """The engine with the default threshold (``weight_left``: prompt chunks of more rows still take
    ``x @ W^T``) against ``x @ W^T`` everywhere. Prefix caching is off: every run prefills its prompts in full,
    and neither arm reads keys and values the other wrote."""
    arms = {"weight_left": default, "x_left": 0}
    llm = LLM(enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [100] * 16}], SamplingParams(max_tokens=4), use_tqdm=False)
    out = {}
    for streams in streams_list:
        rng = random.Random(streams)
        prompts = [{"prompt_token_ids": [rng.randrange(100, 49_000) for _ in range(input_len)]} for _ in range(streams)]
        tok_s, tokens = {name: [] for name in arms}, {}
        for _ in range(rounds):
            for name, max_rows in arms.items():
                parallel_layers.CPU_WEIGHT_LEFT_MAX_ROWS = max_rows
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                tok_s[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
                tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
        med = {name: statistics.median(v) for name, v in tok_s.items()}
        same = sum(a == b for a, b in zip(tokens["weight_left"], tokens["x_left"]))
        out[str(streams)] = {"output_tokens_per_s": tok_s, "median": med,
                             "weight_left_over_x_left": med["weight_left"] / med["x_left"],
                             "same_greedy_tokens": f"{same} of {streams}"}
        print(f"{streams:3d} streams: W @ x^T {med['weight_left']:.1f}, x @ W^T {med['x_left']:.1f} output tok/s; "
              f"same tokens {same} of {streams}", flush=True)
    return {"input_len": input_len, "output_len": output_len, "streams": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--engine-rounds", type=int, default=3, help="0 skips the engine part")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    default = parallel_layers.CPU_WEIGHT_LEFT_MAX_ROWS
    result = {"command": "python " + shlex.join(sys.argv), "commit": current_commit(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": platform.machine(),
              "torch_threads": torch.get_num_threads(), "default_weight_left_max_rows": default,
              "gemms_alone": gemms_alone(args.rows, args.rounds)}
    if args.engine_rounds:
        result["engine"] = engine_rounds(args.streams, args.engine_rounds, args.input_len, args.output_len, default)
    parallel_layers.CPU_WEIGHT_LEFT_MAX_ROWS = default
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1) + "\n")
        print("wrote", args.output_json)


if __name__ == "__main__":
    main()
