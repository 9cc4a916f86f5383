#!/usr/bin/env python
"""Tenant GPU shares through the serving path: tenants flood a running server (``manage.py serve``)
with streamed completions (``X-Tenant-ID``, random token ids, ``ignore_eos``), and the split of
the output tokens is measured while every tenant still has requests waiting.

Scenarios (``--scenarios``, in order):

* ``uniform``: each tenant of ``--tenants`` sends ``--num-prompts`` requests at once, all of
  ``--output-len`` tokens;
* ``random``: the same with output lengths uniform in ``--random-output-min..max``;
* ``alone``: the first tenant alone sends as many requests as all tenants together in
  ``uniform``; its output tokens/s against ``uniform``'s (the cost of sharing);
* ``late``: the first tenant sends twice ``--num-prompts``; ``--late-delay`` seconds later the
  second sends ``--late-prompts``: their time to first token against that of the flood's
  requests still waiting when they arrived (from the late arrival to their first token);
* ``three``: the tenants of ``--three`` (``slug=share``; their shares are set in the database,
  which publishes them to the workers) flood as in ``uniform``.

The share of a tenant is its output tokens within the window from the first token of the
scenario to the moment the first tenant's last request got its first token (after that, that
tenant has nothing waiting); a request's tokens are spread evenly between its first token and
its end. Every request must end with exactly its ``max_tokens`` (nothing lost or duplicated).

    python benchmarks/tenant_shares.py --base-url http://127.0.0.1:8000 --model qwen2.5-7b \\
        --tenants team1=30,team2=70 --three a=20,b=30,c=50 --result-json benchmarks/results/x.json

``--three`` needs the server's database (``TESSERA_DB_PATH``) and Redis (``REDIS_URL``) in the
environment. Writes JSON with the command and the commit.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

from provenance import current_commit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.serving import RequestResult, send_one  # noqa: E402


def parse_shares(text: str) -> dict[str, float]:
    """``"a=30,b=70"`` -> ``{"a": 30.0, "b": 70.0}``."""
    out = {}
    for part in text.split(","):
        slug, _, share = part.partition("=")
        out[slug.strip()] = float(share.rstrip("%"))
    return out


def prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    return [[rng.randrange(1000, 30000) for _ in range(length)] for _ in range(count)]


async def flood(args, plan: list[tuple[str, list[int], int, float]]) -> list[tuple[str, int, RequestResult]]:
    """Send ``(tenant, prompt, max_tokens, delay_s)`` requests (each after its delay) at once;
    returns ``(tenant, max_tokens, result)`` in plan order."""
    async def one(tenant: str, prompt: list[int], max_tokens: int, delay: float) -> tuple[str, int, RequestResult]:
        if delay:
            await asyncio.sleep(delay)
        body = {"model": args.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        return tenant, max_tokens, await send_one(args.base_url, body, {"X-Tenant-ID": tenant})

    return await asyncio.gather(*(one(*p) for p in plan))


def tokens_between(result: RequestResult, start: float, end: float) -> float:
    """The request's output tokens produced within [start, end] (perf_counter s), spread evenly
    between its first token and its end."""
    first, last = result.started + result.ttft, result.started + result.latency
    if result.output_tokens <= 0 or end <= first:
        return 0.0
    if last <= first:
        return float(result.output_tokens) if start <= first <= end else 0.0
    overlap = max(0.0, min(end, last) - max(start, first))
    return result.output_tokens * overlap / (last - first)


def summarize(name: str, results: list[tuple[str, int, RequestResult]], goal: dict[str, float] | None) -> dict:
    """Shares in the contended window, throughput, TTFT, and whether anything was lost."""
    ok = [(t, m, r) for t, m, r in results if r.success]
    failed = [r.error for _, _, r in results if not r.success]
    wrong_length = sum(1 for _, m, r in ok if r.output_tokens != m)
    tenants = sorted({t for t, _, _ in results})
    begin = min(r.started for _, _, r in results)
    end = max(r.started + r.latency for _, _, r in results)
    out: dict = {"scenario": name, "requests": len(results), "failed": len(failed), "errors": failed[:5],
                 "wrong_length": wrong_length, "duration_s": round(end - begin, 3),
                 "output_tokens": sum(r.output_tokens for _, _, r in ok)}
    out["output_throughput"] = round(out["output_tokens"] / (end - begin), 1)
    out["median_ttft_ms"] = {t: round(1000 * statistics.median(r.ttft for tt, _, r in ok if tt == t), 1)
                             for t in tenants if any(tt == t for tt, _, _ in ok)}
    if len(tenants) > 1 and ok:
        first = min(r.started + r.ttft for _, _, r in ok)
        last_start = min(max(r.started + r.ttft for tt, _, r in ok if tt == t) for t in tenants)
        window = {t: sum(tokens_between(r, first, last_start) for tt, _, r in ok if tt == t) for t in tenants}
        total = sum(window.values()) or 1.0
        out["window_s"] = round(last_start - first, 3)
        out["window_tokens"] = {t: round(v) for t, v in window.items()}
        out["share_pct"] = {t: round(100 * v / total, 2) for t, v in window.items()}
        if goal:
            weights = sum(goal.values())
            out["goal_pct"] = {t: round(100 * goal[t] / weights, 2) for t in tenants}
            out["max_deviation_points"] = round(max(abs(out["share_pct"][t] - out["goal_pct"][t]) for t in tenants), 2)
    return out


def set_shares(shares: dict[str, float]) -> None:
    """Create or update these tenants with these GPU shares (saving publishes them to the workers)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()
    from tenants.models import Tenant

    for slug, share in shares.items():
        Tenant.objects.update_or_create(slug=slug, defaults={"name": slug, "gpu_share": int(share), "active": True})


def late_summary(args, results: list[tuple[str, int, RequestResult]], late_tenant: str) -> dict:
    """The late tenant's time to first token against the flood's requests still waiting when it came."""
    late = [r for t, _, r in results if t == late_tenant and r.success]
    arrival = min(r.started for r in late)
    waiting = [r.started + r.ttft - arrival for t, _, r in results
               if t != late_tenant and r.success and r.started + r.ttft > arrival]
    return {"late_tenant": late_tenant, "late_requests": len(late), "late_delay_s": args.late_delay,
            "late_median_ttft_ms": round(1000 * statistics.median(r.ttft for r in late), 1),
            "late_max_ttft_ms": round(1000 * max(r.ttft for r in late), 1),
            "flood_waiting_at_arrival": len(waiting),
            "flood_median_first_token_after_arrival_ms": round(1000 * statistics.median(waiting), 1) if waiting else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tenants", default="team1=30,team2=70", help="slug=share,... as the server has them")
    parser.add_argument("--three", default="", help="slug=share,... for the three-tenant scenario (set here)")
    parser.add_argument("--scenarios", default="uniform,random,alone,late,three")
    parser.add_argument("--num-prompts", type=int, default=256, help="requests per tenant")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--random-output-min", type=int, default=64)
    parser.add_argument("--random-output-max", type=int, default=448)
    parser.add_argument("--late-delay", type=float, default=3.0)
    parser.add_argument("--late-prompts", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default="")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    shares = parse_shares(args.tenants)
    tenants = list(shares)
    report: dict = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%d"),
                    "host": platform.node(), "scenarios": []}
    try:
        report["commit"] = current_commit()
    except OSError:
        report["commit"] = None
    n, out_len = args.num_prompts, args.output_len
    warm = [(tenants[0], p, 8, 0.0) for p in prompts(rng, 4, args.input_len)]
    asyncio.run(flood(args, warm))
    for scenario in args.scenarios.split(","):
        if scenario == "uniform":
            plan = [(t, p, out_len, 0.0) for p in prompts(rng, n, args.input_len) for t in tenants]
            report["scenarios"].append(summarize(scenario, asyncio.run(flood(args, plan)), shares))
        elif scenario == "random":
            plan = [(t, p, rng.randint(args.random_output_min, args.random_output_max), 0.0)
                    for p in prompts(rng, n, args.input_len) for t in tenants]
            report["scenarios"].append(summarize(scenario, asyncio.run(flood(args, plan)), shares))
        elif scenario == "alone":
            plan = [(tenants[0], p, out_len, 0.0) for p in prompts(rng, n * len(tenants), args.input_len)]
            alone = summarize(scenario, asyncio.run(flood(args, plan)), None)
            shared = next((s for s in report["scenarios"] if s["scenario"] == "uniform"), None)
            if shared:
                alone["shared_over_alone_throughput"] = round(shared["output_throughput"] / alone["output_throughput"], 4)
            report["scenarios"].append(alone)
        elif scenario == "late":
            plan = [(tenants[0], p, out_len, 0.0) for p in prompts(rng, 2 * n, args.input_len)]
            plan += [(tenants[1], p, out_len, args.late_delay) for p in prompts(rng, args.late_prompts, args.input_len)]
            results = asyncio.run(flood(args, plan))
            entry = summarize(scenario, results, None)
            entry.update(late_summary(args, results, tenants[1]))
            report["scenarios"].append(entry)
        elif scenario == "three" and args.three:
            three = parse_shares(args.three)
            set_shares(three)
            time.sleep(2.0)  # the workers read the shares with their next heartbeat
            plan = [(t, p, out_len, 0.0) for p in prompts(rng, n, args.input_len) for t in three]
            report["scenarios"].append(summarize(scenario, asyncio.run(flood(args, plan)), three))
        print(json.dumps(report["scenarios"][-1], indent=1) if report["scenarios"] else "", flush=True)
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(report, indent=2) + "\n")
        print("wrote", args.result_json)


if __name__ == "__main__":
    main()
