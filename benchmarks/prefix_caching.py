"""Automatic prefix caching: TTFT and prefill tokens with caching on and off.

Every prompt is one shared "system prompt" of ``--system-len`` random tokens followed by its own
suffix. Two workloads run on one engine per setting:

* sequential: one request at a time, so TTFT is the prefill of that request alone (after the
  first request, the system prompt is cached when caching is on);
* batch: all requests at once (continuous batching) on a fresh engine, the total time and the
  TTFT distribution (requests admitted in the first step find nothing cached yet).

``--workloads`` picks one of them. Prefill tokens are the prompt positions the engine actually
computed (``EngineStats.prompt_tokens_computed_total``), which prefix hits skip. On a GPU each engine
first generates 2 tokens for ``--warmup-prompts`` prompts of another system prompt, so that the
timed runs build no Triton kernel (``triton_builds`` reports any left).

    python benchmarks/prefix_caching.py                                  # CPU: SmolLM2, 1,000-token system prompt
    python benchmarks/prefix_caching.py --model qwen2.5-7b --load-format dummy --dtype bfloat16 \
        --workloads batch --num-prompts 256 --system-len 1024 --max-num-batched-tokens 16384   # GPU

Writes JSON (figures and the exact command) to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from step_profile import TritonCompileWatch
from throughput import warm_up

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import LLM, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def make_prompts(args, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
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


def _engine(args, caching: bool, warmup: list[list[int]]):
    """A fresh engine, its Triton kernels built on ``warmup`` (prompts of another system prompt)."""
    llm = LLM(model=args.model, dtype=args.dtype, load_format=args.load_format, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_space=args.kv_cache_space, enable_prefix_caching=caching, seed=args.seed)
    if warmup:
        warm_up(llm, warmup, count=len(warmup) // 2)
    return llm.llm_engine


def _release() -> None:
    """Return a dropped engine's GPU memory before the next one sizes its KV cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sequential(engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """One request in the engine at a time."""
    before = engine.get_stats().prompt_tokens_computed_total
    ttfts = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"seq-{i}", prompt, params)
        metrics = _drain(engine)[f"seq-{i}"]
        ttfts.append(metrics["first_token"] - metrics["arrival"])
    return {**_summary(ttfts[1:]), "first_request_ttft_ms": 1000 * ttfts[0],
            "prefill_tokens": engine.get_stats().prompt_tokens_computed_total - before}


def _batch(engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Every request at once, one arrival time."""
    stats = engine.get_stats()
    start = time.perf_counter()
    arrival = time.monotonic()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"batch-{i}", prompt, params, arrival_time=arrival)
    metrics = _drain(engine)
    after = engine.get_stats()
    return {**_summary([m["first_token"] - m["arrival"] for m in metrics.values()]),
            "seconds": time.perf_counter() - start,
            "prefill_tokens": after.prompt_tokens_computed_total - stats.prompt_tokens_computed_total,
            "prefix_cache_hit_rate": ((after.prefix_cache_hits_total - stats.prefix_cache_hits_total)
                                      / max(1, after.prefix_cache_queries_total - stats.prefix_cache_queries_total))}


def run(args, prompts: list[list[int]], warmup: list[list[int]], caching: bool) -> dict:
    """``args.workloads`` with caching on or off, each on a fresh engine."""
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    result = {}
    for name, workload in (("sequential", _sequential), ("batch", _batch)):
        if name not in args.workloads:
            continue
        engine = _engine(args, caching, warmup)
        with TritonCompileWatch() as builds:
            result[name] = workload(engine, prompts, params)
        result[name]["triton_builds"] = builds.report()["count"]
        device = engine.config.device
        del engine
        _release()
    return {**result, "device": device}


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
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step (engine default)")
    parser.add_argument("--kv-cache-space", type=float, default=1.0, help="GiB of KV cache on CPU")
    parser.add_argument("--workloads", nargs="+", choices=["sequential", "batch"], default=["sequential", "batch"])
    parser.add_argument("--warmup-prompts", type=int, default=None,
                        help="prompts each engine generates 2 tokens for before the timed runs "
                             "(default: 33 on a GPU, none on the CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.warmup_prompts is None:
        args.warmup_prompts = 33 if torch.cuda.is_available() else 0
    from inference.model_loader import load_hf_config, resolve_model
    vocab = load_hf_config(resolve_model(args.model, load_format=args.load_format).model_dir).vocab_size
    prompts = make_prompts(args, vocab, args.seed)
    warmup = make_prompts(args, vocab, args.seed + 1)[:args.warmup_prompts]  # another system prompt
    off = run(args, prompts, warmup, caching=False)
    on = run(args, prompts, warmup, caching=True)
    result = {
        "command": "python " + shlex.join(sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": platform.machine(), "torch_threads": torch.get_num_threads(),
        "workload": {"model": args.model, "num_prompts": args.num_prompts, "system_len": args.system_len,
                     "prompt_tokens": sum(map(len, prompts)), "output_len": args.output_len,
                     "warmup_prompts": len(warmup)},
        "caching_off": off, "caching_on": on,
    }
    if "sequential" in args.workloads:
        result["sequential_ttft_speedup"] = off["sequential"]["mean_ttft_ms"] / on["sequential"]["mean_ttft_ms"]
        result["sequential_prefill_token_reduction"] = (1 - on["sequential"]["prefill_tokens"]
                                                        / off["sequential"]["prefill_tokens"])
    if "batch" in args.workloads:
        result["batch_median_ttft_speedup"] = off["batch"]["median_ttft_ms"] / on["batch"]["median_ttft_ms"]
        result["batch_prefill_token_reduction"] = 1 - on["batch"]["prefill_tokens"] / off["batch"]["prefill_tokens"]
    print(json.dumps(result, indent=2))
    RESULTS.mkdir(exist_ok=True)
    path = Path(args.output_json) if args.output_json else RESULTS / f"prefix_caching_{args.model.replace('/', '_')}_{on['device']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
