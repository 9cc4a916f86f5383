"""Automatic prefix caching: TTFT and prefill tokens with caching on and off.

Every prompt is one shared "system prompt" of ``--system-len`` random tokens followed by its own
suffix. Two workloads run on one engine per setting:

* sequential: one request at a time, so TTFT is the prefill of that request alone (after the
  first request, the system prompt is cached when caching is on);
* batch: all requests at once (continuous batching) on a fresh engine, the total time and the
  TTFT distribution (requests admitted in the first step find nothing cached yet).

Prefill tokens are the prompt positions the engine actually computed
(``EngineStats.prompt_tokens_computed_total``), which prefix hits skip.

    python benchmarks/prefix_caching.py                                  # CPU: SmolLM2, 1,000-token system prompt
    python benchmarks/prefix_caching.py --num-prompts 100 --model qwen2.5-7b --load-format dummy \
        --dtype bfloat16                                                 # GPU

Writes JSON (figures and the exact command) to benchmarks/results/.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import LLM, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def make_prompts(args, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(100, vocab_size - 100) for _ in range(args.system_len)]
    return [system + [rng.randrange(100, vocab_size - 100) for _ in range(rng.randint(args.min_suffix, args.max_suffix))]
            for _ in range(args.num_prompts)]


def _drain(engine) -> dict[str, dict]:
    done: dict[str, dict] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.metrics
    return done


def _summary(ttfts: list[float]) -> dict:
    ordered = sorted(ttfts)
    return {"mean_ttft_ms": 1000 * statistics.fmean(ordered), "median_ttft_ms": 1000 * statistics.median(ordered),
            "p99_ttft_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def _engine(args, caching: bool):
    return LLM(model=args.model, dtype=args.dtype, load_format=args.load_format, max_model_len=args.max_model_len,
               kv_cache_space=args.kv_cache_space, enable_prefix_caching=caching, seed=args.seed).llm_engine


def run(args, prompts: list[list[int]], caching: bool) -> dict:
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    result = {}
    # Sequential: one request in the engine at a time.
    engine = _engine(args, caching)
    before = engine.get_stats().prompt_tokens_computed_total
    ttfts = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"seq-{i}", prompt, params)
        metrics = _drain(engine)[f"seq-{i}"]
        ttfts.append(metrics["first_token"] - metrics["arrival"])
    result["sequential"] = {**_summary(ttfts[1:]), "first_request_ttft_ms": 1000 * ttfts[0],
                            "prefill_tokens": engine.get_stats().prompt_tokens_computed_total - before}
    # Batch: everything at once.
    engine = _engine(args, caching)
    stats = engine.get_stats()
    start = time.perf_counter()
    arrival = time.monotonic()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"batch-{i}", prompt, params, arrival_time=arrival)
    metrics = _drain(engine)
    after = engine.get_stats()
    result["batch"] = {**_summary([m["first_token"] - m["arrival"] for m in metrics.values()]),
                       "seconds": time.perf_counter() - start,
                       "prefill_tokens": after.prompt_tokens_computed_total - stats.prompt_tokens_computed_total,
                       "prefix_cache_hit_rate": ((after.prefix_cache_hits_total - stats.prefix_cache_hits_total)
                                                 / max(1, after.prefix_cache_queries_total
                                                       - stats.prefix_cache_queries_total))}
    result["device"] = engine.config.device
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=1000)
    parser.add_argument("--min-suffix", type=int, default=8)
    parser.add_argument("--max-suffix", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-space", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    from inference.model_loader import load_hf_config, resolve_model
    vocab = load_hf_config(resolve_model(args.model, load_format=args.load_format).model_dir).vocab_size
    prompts = make_prompts(args, vocab)
    off = run(args, prompts, caching=False)
    on = run(args, prompts, caching=True)
    result = {
        "command": "python " + shlex.join(sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": platform.machine(), "torch_threads": torch.get_num_threads(),
        "workload": {"model": args.model, "num_prompts": args.num_prompts, "system_len": args.system_len,
                     "prompt_tokens": sum(map(len, prompts)), "output_len": args.output_len},
        "caching_off": off, "caching_on": on,
        "sequential_ttft_speedup": off["sequential"]["mean_ttft_ms"] / on["sequential"]["mean_ttft_ms"],
        "batch_prefill_token_reduction": 1 - on["batch"]["prefill_tokens"] / off["batch"]["prefill_tokens"],
        "sequential_prefill_token_reduction": 1 - on["sequential"]["prefill_tokens"] / off["sequential"]["prefill_tokens"],
    }
    print(json.dumps(result, indent=2))
    RESULTS.mkdir(exist_ok=True)
    path = Path(args.output_json) if args.output_json else RESULTS / f"prefix_caching_{args.model.replace('/', '_')}_{on['device']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
