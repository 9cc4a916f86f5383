"""Tenant GPU shares in the engine (``inference/sched/fair_share.py``), measured on a real engine.

Three figures, each from a run that drives ``LLMEngine.step()`` with tenants that keep
``--backlog`` requests waiting (identical workloads, ignore_eos):

1. **split**: two tenants at 30% and 70% flooding; the tokens computed for each over
   ``--steps`` steps after ``--warmup`` (acceptance: 30/70 within 5 points);
2. **alone**: one tenant flooding with shares on, against the same run with shares off
   (acceptance: at least 95% of the throughput; runs alternate off/on, best of ``--repeats``);
3. **late**: tenants a and b (a third each) flood; tenant c arrives after ``--warmup`` steps:
   the admission rounds (steps that admit a request) until c's first request is admitted,
   the steps until its first token, and c's part of the tokens over the next ``--steps``
   steps (no burst: about a third).

    python benchmarks/fair_share.py                                   # CPU: SmolLM2
    python benchmarks/fair_share.py --model qwen2.5-0.5b --load-format dummy --dtype bfloat16 \\
        --max-num-seqs 64 --input-len 256 --output-len 128 --steps 600   # GPU

Writes JSON (figures and the exact command) to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import SamplingParams  # noqa: E402
from inference.engine import EngineArgs, LLMEngine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class Flood:
    """Keeps ``backlog`` requests of each tenant waiting in the engine."""

    def __init__(self, engine: LLMEngine, args) -> None:
        self.engine = engine
        self.backlog = args.backlog
        self.prompt = [(100 + 7 * i) % 30000 + 10 for i in range(args.input_len)]
        self.params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        self.ids = itertools.count()

    def top_up(self, tenants: list[str]) -> None:
        waiting = Counter(r.tenant_id for r in self.engine.scheduler.waiting)
        for tenant in tenants:
            for _ in range(self.backlog - waiting[tenant]):
                self.engine.add_request(f"{tenant}-{next(self.ids)}", self.prompt, self.params, tenant_id=tenant)

    def clear(self) -> None:
        scheduler = self.engine.scheduler
        self.engine.abort_request(list({r.parent_id for r in [*scheduler.running, *scheduler.waiting]}), report=False)
        self.engine.step()


def run_split(engine: LLMEngine, args) -> dict:
    engine.set_tenant_shares({"team1": 30, "team2": 70})
    fair = engine.scheduler.fair_share
    flood = Flood(engine, args)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            start = dict(fair.served_tokens)
        flood.top_up(["team1", "team2"])
        engine.step()
    served = {t: fair.served_tokens.get(t, 0) - start.get(t, 0) for t in ("team1", "team2")}
    flood.clear()
    share = served["team1"] / sum(served.values())
    return {"shares": {"team1": 30, "team2": 70}, "served_tokens": served, "team1_percent": 100 * share,
            "within_5_points": abs(100 * share - 30) <= 5}


def _alone_once(engine: LLMEngine, args, shares: bool) -> float:
    engine.scheduler.fair_share = None
    if shares:
        engine.set_tenant_shares({"team1": 30, "team2": 70})
    flood = Flood(engine, args)
    for _ in range(args.warmup):
        flood.top_up(["team1"])
        engine.step()
    produced = 0
    if engine.config.device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        flood.top_up(["team1"])
        produced += sum(len(o.token_ids) for out in engine.step() for o in out.outputs)
    elapsed = time.perf_counter() - start
    flood.clear()
    return produced / elapsed


def run_alone(engine: LLMEngine, args) -> dict:
    off, on = [], []
    for _ in range(args.repeats):
        off.append(_alone_once(engine, args, shares=False))
        on.append(_alone_once(engine, args, shares=True))
    ratio = max(on) / max(off)
    return {"output_tokens_per_s_shares_off": off, "output_tokens_per_s_shares_on": on,
            "ratio_best_on_over_best_off": ratio, "at_least_95_percent": ratio >= 0.95}


def run_late(engine: LLMEngine, args) -> dict:
    engine.scheduler.fair_share = None
    engine.set_tenant_shares({"a": 33, "b": 33, "c": 33})
    fair = engine.scheduler.fair_share
    flood = Flood(engine, args)
    for _ in range(args.warmup):
        flood.top_up(["a", "b"])
        engine.step()
    start = dict(fair.served_tokens)
    rounds, admitted_round, first_token_step = 0, None, None
    for step in range(1, args.steps + 1):
        flood.top_up(["a", "b", "c"])
        before = {r.request_id for r in engine.scheduler.running}
        outputs = engine.step()
        admitted = [r for r in engine.scheduler.running if r.request_id not in before]
        if admitted and admitted_round is None:
            rounds += 1
            if any(r.tenant_id == "c" for r in admitted):
                admitted_round = rounds
        if first_token_step is None and any(o.request_id.startswith("c-") and o.outputs and o.outputs[0].token_ids
                                            for o in outputs):
            first_token_step = step
    served = {t: fair.served_tokens.get(t, 0) - start.get(t, 0) for t in ("a", "b", "c")}
    flood.clear()
    return {"admission_round_of_first_request": admitted_round, "steps_to_first_token": first_token_step,
            "served_tokens_after_arrival": served, "c_percent": 100 * served["c"] / sum(served.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--kv-cache-space", type=float, default=0.5)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--backlog", type=int, default=0, help="waiting requests per tenant (0: 2 x max-num-seqs)")
    parser.add_argument("--warmup", type=int, default=20, help="steps before measuring")
    parser.add_argument("--steps", type=int, default=100, help="steps measured")
    parser.add_argument("--repeats", type=int, default=2, help="off/on pairs of the single-tenant run")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    args.backlog = args.backlog or 2 * args.max_num_seqs

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_space=args.kv_cache_space))
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": platform.processor() or platform.machine(), "device": engine.config.device,
              "gpu": torch.cuda.get_device_name() if engine.config.device != "cpu" else None,
              "workload": {k: getattr(args, k) for k in ("model", "max_num_seqs", "max_num_batched_tokens",
                                                         "input_len", "output_len", "backlog", "warmup", "steps")}}
    result["split"] = split = run_split(engine, args)
    print(f"split:  team1 (30%) got {split['team1_percent']:.1f}% of {sum(split['served_tokens'].values())} tokens")
    result["alone"] = alone = run_alone(engine, args)
    print(f"alone:  shares on / off = {alone['ratio_best_on_over_best_off']:.3f} "
          f"({max(alone['output_tokens_per_s_shares_on']):.1f} vs {max(alone['output_tokens_per_s_shares_off']):.1f}"
          " output tok/s)")
    result["late"] = late = run_late(engine, args)
    print(f"late:   c admitted in admission round {late['admission_round_of_first_request']}, first token after "
          f"{late['steps_to_first_token']} steps, {late['c_percent']:.1f}% of the tokens since")
    RESULTS.mkdir(exist_ok=True)
    name = Path(args.model).name
    path = Path(args.output_json) if args.output_json else RESULTS / f"fair_share_{name}_{engine.config.device}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
