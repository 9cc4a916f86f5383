#!/usr/bin/env python
"""Serving benchmark with vLLM's ``benchmark_serving`` options and report.

Sends a random-token workload to a running server's ``/v1/completions`` (streaming) and
reports throughput, TTFT, TPOT and ITL. With ``--offline`` it then runs the same workload
on an in-process ``LLMEngine`` (same concurrency) and reports the serving/offline
throughput ratio and the median TTFT overhead of the serving path; ``--paired-ttft``
measures only that overhead, prompt by prompt (server, then in-process engine), which
stays meaningful on a machine shared with other work. ``--save-result``
writes everything, with the exact command, as JSON under ``--result-dir``.

Example (server started with ``make serve``)::

    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct \\
        --dataset-name random --random-input-len 128 --random-output-len 64 --num-prompts 64 \\
        --max-concurrency 16 --ignore-eos --offline --save-result
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RequestResult:
    """One request's timings (seconds) and token counts."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    started: float = 0.0  # time.perf_counter() when it was sent
    itl: list[float] = field(default_factory=list)


def random_prompts(num: int, input_len: int, range_ratio: float, seed: int, vocab: tuple[int, int]) -> list[list[int]]:
    """Prompts of random token ids (as vLLM's random dataset), lengths in
    ``[input_len * (1 - range_ratio), input_len]``."""
    rng = random.Random(seed)
    low = max(1, int(input_len * (1 - range_ratio)))
    return [[rng.randrange(*vocab) for _ in range(rng.randint(low, input_len))] for _ in range(num)]


async def send_one(base_url: str, body: dict, headers: dict[str, str] | None = None) -> RequestResult:
    """Stream one completion (with ``headers`` added); TTFT is the first chunk with text, ITL the
    gaps after it."""
    result = RequestResult(prompt_len=len(body["prompt"]))
    host, port = base_url.removeprefix("http://").rstrip("/").split(":")
    payload = json.dumps(body).encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    start = result.started = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{extra}"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        last = None
        while line := await reader.readline():
            if not line.startswith(b"data: "):
                if status != 200 and line.strip().startswith(b"{"):
                    result.error = line.decode(errors="replace")
                continue
            data = line[6:].strip()
            now = time.perf_counter()
            if data == b"[DONE]":
                result.success = status == 200 and not result.error
                break
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = chunk["error"]["message"]
                continue
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        writer.close()
        if status != 200 and not result.error:
            result.error = f"HTTP {status}"
    except OSError as error:
        result.error = str(error)
    return result


def auth_headers(args: argparse.Namespace) -> dict[str, str]:
    """``Authorization: Bearer`` with ``--api-key``, where one is given."""
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def run_serving(args, prompts: list[list[int]]) -> tuple[list[RequestResult], float]:
    semaphore = asyncio.Semaphore(args.max_concurrency or len(prompts))
    rng = random.Random(args.seed)

    async def limited(prompt: list[int]) -> RequestResult:
        async with semaphore:
            body = {"model": args.model, "prompt": prompt, "max_tokens": args.random_output_len, "stream": True,
                    "stream_options": {"include_usage": True}, "temperature": 0, "ignore_eos": args.ignore_eos}
            return await send_one(args.base_url, body, auth_headers(args))

    tasks = []
    start = time.perf_counter()
    for prompt in prompts:
        tasks.append(asyncio.ensure_future(limited(prompt)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def run_offline(args, prompts: list[list[int]]) -> dict:
    """The same prompts on an in-process engine, at most ``--max-concurrency`` at once."""
    engine = _offline_engine(args)
    from inference import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.random_output_len, ignore_eos=args.ignore_eos)
    limit = args.max_concurrency or len(prompts)
    pending = list(enumerate(prompts))
    added, first_token, generated, active = {}, {}, 0, 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and active < limit:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, params)
            added[str(i)] = time.perf_counter()
            active += 1
        for out in engine.step():
            now = time.perf_counter()
            new = sum(len(c.token_ids) for c in out.outputs)
            if new and out.request_id not in first_token:
                first_token[out.request_id] = now - added[out.request_id]
            generated += new
            active -= out.finished
    duration = time.perf_counter() - start
    ttfts = list(first_token.values())
    return {"duration": duration, "output_throughput": generated / duration, "total_output_tokens": generated,
            "median_ttft_ms": 1000 * statistics.median(ttfts), "mean_ttft_ms": 1000 * statistics.mean(ttfts)}


def _offline_engine(args):
    sys.path.insert(0, str(ROOT))
    from inference import EngineArgs, LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(model=args.model, max_model_len=args.max_model_len,
                                                 kv_cache_space=args.kv_cache_space))


def run_paired_ttft(args, prompts: list[list[int]]) -> dict:
    """TTFT overhead of the serving path, robust to a busy machine: each prompt goes to the
    server and then to an in-process engine, one at a time, ``--paired-repeats`` times; the
    fastest of each side is kept (other jobs only ever add time), and the per-prompt
    differences are summarized (max_tokens=1, so each side measures prefill only).

    Two engines in two processes can differ by a few ms per prefill whatever the serving
    path does, so the server's own prefill time is subtracted too: the mean client TTFT
    minus the mean of ``vllm:request_prefill_time_seconds`` over the same requests
    (first scheduled to first token, from ``/metrics``) is everything but the engine step."""
    engine = _offline_engine(args)
    from inference import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    served, offline, every_served = [], [], []
    prefill_before = _server_histogram(args.base_url, "vllm:request_prefill_time_seconds", args.model)
    for i, prompt in enumerate(prompts):
        body = {"model": args.model, "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0,
                "ignore_eos": True}
        tries_served, tries_offline = [], []
        for k in range(args.paired_repeats):
            result = asyncio.run(send_one(args.base_url, body, auth_headers(args)))
            start = time.perf_counter()
            engine.add_request(f"paired-{i}-{k}", prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
            if result.success and result.ttft:
                tries_served.append(1000 * result.ttft)
                tries_offline.append(1000 * (time.perf_counter() - start))
        if tries_served:
            served.append(min(tries_served))
            offline.append(min(tries_offline))
            every_served += tries_served
    diffs = [s - o for s, o in zip(served, offline)]
    time.sleep(1.2)  # workers publish their metrics with every heartbeat (0.5 s)
    prefill_after = _server_histogram(args.base_url, "vllm:request_prefill_time_seconds", args.model)
    num_prefills = prefill_after[1] - prefill_before[1]
    server_side = {}
    if num_prefills == len(every_served) and num_prefills:  # no other client used the server meanwhile
        mean_prefill = 1000 * (prefill_after[0] - prefill_before[0]) / num_prefills
        server_side = {"mean_server_prefill_ms": mean_prefill,
                       "mean_ttft_minus_server_prefill_ms": statistics.mean(every_served) - mean_prefill}
    return {**server_side, "pairs": len(diffs), "median_served_ttft_ms": statistics.median(served),
            "median_offline_ttft_ms": statistics.median(offline),
            "median_ttft_overhead_ms": statistics.median(diffs), "mean_ttft_overhead_ms": statistics.mean(diffs)}


def _server_histogram(base_url: str, name: str, model: str) -> tuple[float, float]:
    """``(sum, count)`` of histogram ``name`` of ``model`` in the server's ``/metrics``."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {"_sum": 0.0, "_count": 0.0}
    for line in text.splitlines():
        for suffix in values:
            if line.startswith(name + suffix + "{") and f'model_name="{model}"' in line:
                values[suffix] += float(line.split()[-1])
    return values["_sum"], values["_count"]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    ttft = [r.ttft * 1000 for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok if r.output_tokens > 1]
    itl = [x * 1000 for r in ok for x in r.itl]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    metrics = {"completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
               "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
               "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
               "total_token_throughput": (in_tokens + out_tokens) / duration,
               "errors": sorted({r.error for r in results if r.error})[:5]}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        metrics[f"mean_{name}_ms"] = statistics.mean(values) if values else 0.0
        metrics[f"median_{name}_ms"] = statistics.median(values) if values else 0.0
        metrics[f"p99_{name}_ms"] = _pct(values, 99)
    return metrics


def report(m: dict) -> None:
    line = lambda label, value: print(f"{label:<40}{value:<10.2f}" if isinstance(value, float) else f"{label:<40}{value:<10}")
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    line("Successful requests:", m["completed"])
    line("Benchmark duration (s):", m["duration"])
    line("Total input tokens:", m["total_input_tokens"])
    line("Total generated tokens:", m["total_output_tokens"])
    line("Request throughput (req/s):", m["request_throughput"])
    line("Output token throughput (tok/s):", m["output_throughput"])
    line("Total Token throughput (tok/s):", m["total_token_throughput"])
    for title, key, unit in (("Time to First Token", "ttft", "TTFT"),
                             ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
                             ("Inter-token Latency", "itl", "ITL")):
        print("{s:{c}^50}".format(s=title, c="-"))
        line(f"Mean {unit} (ms):", m[f"mean_{key}_ms"])
        line(f"Median {unit} (ms):", m[f"median_{key}_ms"])
        line(f"P99 {unit} (ms):", m[f"p99_{key}_ms"])
    if "offline" in m:
        print("{s:{c}^50}".format(s="Offline engine, same workload", c="-"))
        line("Offline output throughput (tok/s):", m["offline"]["output_throughput"])
        line("Serving / offline throughput:", m["throughput_ratio"])
        line("Offline median TTFT (ms):", m["offline"]["median_ttft_ms"])
        line("Median TTFT overhead (ms):", m["median_ttft_overhead_ms"])
    if m["errors"]:
        print("Errors:", *m["errors"], sep="\n  ")
    print("=" * 50)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer key sent with every request (default: $OPENAI_API_KEY, as vLLM's benchmark client); "
                        "never written to the result file.")
    p.add_argument("--dataset-name", default="random", choices=["random"])
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-token-range", type=int, nargs=2, default=(1000, 30000), metavar=("LOW", "HIGH"),
                   help="Token ids of the random prompts are drawn from [LOW, HIGH) (a model with a small "
                        "vocabulary needs HIGH at most its vocabulary size).")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Requests/s (Poisson); inf: all at once.")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offline", action="store_true", help="Also run the workload on an in-process engine.")
    p.add_argument("--paired-ttft", action="store_true",
                   help="Only measure the TTFT overhead: each prompt to the server, then to an in-process engine.")
    p.add_argument("--paired-repeats", type=int, default=3,
                   help="With --paired-ttft: tries per prompt on each side; the fastest counts.")
    p.add_argument("--max-model-len", type=int, default=2048, help="Offline engine's context (match the server's).")
    p.add_argument("--kv-cache-space", type=float, default=1.0, help="Offline engine's KV cache, GiB.")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--result-filename", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    prompts = random_prompts(args.num_prompts, args.random_input_len, args.random_range_ratio, args.seed,
                             tuple(args.random_token_range))
    if args.paired_ttft:
        metrics = run_paired_ttft(args, prompts)
        print("{s:{c}^50}".format(s=" Paired TTFT overhead (max_tokens=1) ", c="="))
        for key, value in metrics.items():
            print(f"{key + ':':<40}{value:<10.2f}" if isinstance(value, float) else f"{key + ':':<40}{value}")
        return _save(args, argv, metrics)
    results, duration = asyncio.run(run_serving(args, prompts))
    metrics = summarize(results, duration)
    if args.offline:
        metrics["offline"] = run_offline(args, prompts)
        metrics["throughput_ratio"] = metrics["output_throughput"] / metrics["offline"]["output_throughput"]
        metrics["median_ttft_overhead_ms"] = metrics["median_ttft_ms"] - metrics["offline"]["median_ttft_ms"]
    report(metrics)
    saved = _save(args, argv, metrics)
    if not metrics["completed"]:
        raise SystemExit(f"no request succeeded: {metrics['errors'][0] if metrics['errors'] else 'no reply'}")
    return saved


def _save(args: argparse.Namespace, argv: list[str] | None, metrics: dict) -> dict:
    if args.save_result:
        record = {"command": " ".join(["python", *sys.argv]) if argv is None else " ".join(argv),
                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "backend": "tessera",
                  "host_cpus": os.cpu_count(), "load_average_1_5_15m_at_end": os.getloadavg(), **{k: v for k, v in vars(args).items() if k != "api_key"}, **metrics}
        record["request_rate"] = str(args.request_rate)
        name = args.result_filename or time.strftime(
            f"serving-{args.model}-in{args.random_input_len}-out{args.random_output_len}-c{args.max_concurrency}"
            f"-%Y%m%d-%H%M%S.json")
        Path(args.result_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.result_dir) / name).write_text(json.dumps(record, indent=2))
        print(f"saved {Path(args.result_dir) / name}")
    return metrics


if __name__ == "__main__":
    main()
