"""Late requests: the TTFT of short requests that arrive while a flood (W2) runs, against the same
requests into an idle engine.

The flood (``throughput.py``'s workloads; W2 is ``--workload peer-w2``) is added at once. Once none of
it waits (every prompt scheduled), ``--num-late`` requests of ``--late-input-len`` tokens in and
``--late-output-len`` out arrive one every ``--late-interval`` seconds, the first ``--late-start``
seconds in. One thread drives ``LLMEngine.step()`` and hands each late request to the engine between
two calls, once its arrival time has passed (its ``arrival_time`` stays the planned one). Then the
same requests arrive the same way into the idle engine: the baseline (under another ``cache_salt``,
so that they find none of the first pass's blocks in the prefix cache).

Per late request (times in ms from its arrival):

* ``ttft_ms``: to its first token (``RequestOutput.metrics``); ``ttft_wall_ms``: to the return of
  the ``step()`` call that delivered it;
* ``boundary_ms``: to the end of the ``step()`` call running when it arrived, when the loop hands
  it to the engine (0: it arrived between two calls); ``after_boundary_ms`` = TTFT - boundary;
* ``window_at_arrival``: decode steps of the launch that the call running at arrival waited for
  (on a GPU, most of that call's time; 0: a step with a prefill, None: it arrived between calls);
  ``windows_to_first_token``: the same for each call from its hand-over to its first token, and
  ``calls_to_first_token_ms`` those calls' wall times;
* ``flood_unfinished``: flood requests not finished at its hand-over; ``decode_step_ms``: the
  engine's decode-step average then, from which it sizes its windows.

``--profile-late K`` (a GPU) runs the calls from the hand-over of the flood pass's K-th late request to its
first token under the torch profiler: the pass's ``profile`` holds their kernels (device ms), the device's
busy time against the wall time, and the host's costliest operations, to show where that TTFT goes.

The run's ``window_steps`` (decode-only launches by their number of steps) and ``decode_step_ms``
(the engine's moving average of one decode step) show the windows the engine chose.
``max_num_seqs`` defaults to the flood plus the late requests, so that a late request waits for a
step boundary, not for a seat; pass ``--max-num-seqs 256`` to include that wait.

    python benchmarks/late_requests.py --num-prompts 8 --max-len 64 --num-late 4   # CPU, SmolLM2
    python benchmarks/late_requests.py --model qwen2.5-0.5b --load-format dummy --dtype bfloat16 \\
        --workload peer-w2 --num-prompts 256 --max-model-len 2048 --max-num-batched-tokens 16384   # W2, GPU

Writes JSON (figures and the exact command) to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import bisect
import platform
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from step_profile import TritonCompileWatch, profile_summary
from throughput import (add_workload_args, make_llm, make_workload,  # sets sys.path for inference
                        warm_up, write_result)
from engine_knobs import add_engine_knob_args, apply_engine_knobs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import SamplingParams  # noqa: E402
from inference.sampling_params import RequestOutputKind  # noqa: E402
from inference.sched import decode_windows  # noqa: E402


@dataclass
class LateRequest:
    """One late request of a pass: its plan, and what the driving loop saw of it (``time.monotonic``
    seconds; ``*_call``: indices into the pass's ``step()`` calls)."""

    request_id: str
    prompt: list[int]
    arrival: float = 0.0
    handed_over: float | None = None
    handed_over_call: int = 0  # the first call that saw it
    flood_unfinished: int = 0
    decode_step_s: float | None = None  # the engine's decode-step average at hand-over (sizes its windows)
    first_output: float | None = None  # return of the call that delivered its first token
    first_output_call: int = 0
    metrics: dict = field(default_factory=dict)


@dataclass
class StepCall:
    """One ``LLMEngine.step()`` call: its wall span and the decode steps of the launch it waited for
    (0: a launch with a prefill, or none)."""

    start: float
    end: float
    window: int


def drive(engine, flood: list[tuple[list[int], SamplingParams]], late: list[LateRequest],
          late_params: SamplingParams, start_s: float, interval_s: float, cache_salt: str | None,
          profiled: int | None = None) -> tuple[list[StepCall], dict | None]:
    """Add ``flood`` at once, then step ``engine`` until everything finished, handing each of ``late``
    over between two calls once its arrival time has passed. Arrivals are planned ``start_s``,
    ``start_s + interval_s``, ... seconds after no flood request waits (after the pass began, without
    a flood). Fills in the ``late`` records; returns the calls, and with ``profiled`` (an index into
    ``late``) the profile of the calls from that request's hand-over to its first token."""
    for i, (prompt, params) in enumerate(flood):
        engine.add_request(f"flood-{i}", prompt, params)
    by_id = {r.request_id: r for r in late}
    calls: list[StepCall] = []
    pending, planned, flood_left = list(late), False, len(flood)
    watched = late[profiled] if profiled is not None else None
    prof = prof_started = summary = None
    while pending or engine.has_unfinished_requests():
        now = time.monotonic()
        if not planned and engine.scheduler.num_waiting == 0:
            for k, request in enumerate(late):
                request.arrival = now + start_s + k * interval_s
            planned = True
        while planned and pending and pending[0].arrival <= now:
            request = pending.pop(0)
            engine.add_request(request.request_id, request.prompt, late_params, arrival_time=request.arrival,
                               cache_salt=cache_salt)
            request.handed_over, request.handed_over_call, request.flood_unfinished = now, len(calls), flood_left
            request.decode_step_s = engine.decode_step_seconds
            if request is watched:
                from torch.profiler import ProfilerActivity, profile
                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                prof.__enter__()
                prof_started = time.perf_counter()
        if not engine.has_unfinished_requests():  # idle until the next arrival
            time.sleep(max(0.0, pending[0].arrival - time.monotonic()))
            continue
        windows_before = engine.window_steps.copy()
        began = time.monotonic()
        outputs = engine.step()
        ended = time.monotonic()
        calls.append(StepCall(began, ended, next(iter(engine.window_steps - windows_before), 0)))
        for out in outputs:
            request = by_id.get(out.request_id)
            if request is None:
                flood_left -= out.finished
                continue
            if request.first_output is None and out.outputs and out.outputs[0].token_ids:
                request.first_output, request.first_output_call = ended, len(calls) - 1
                if request is watched:
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    wall_s = time.perf_counter() - prof_started
                    prof.__exit__(None, None, None)
                    summary = {"request_id": request.request_id, **profile_summary(prof, wall_s)}
            if out.finished:
                request.metrics = out.metrics
    return calls, summary


def report(late: list[LateRequest], calls: list[StepCall]) -> dict:
    """The figures of one pass: each late request's, then p50 and p99 over them (ms)."""
    starts = [c.start for c in calls]
    rows = []
    for r in late:
        ttft = r.metrics["first_token"] - r.arrival
        during = bisect.bisect_right(starts, r.arrival) - 1  # the last call begun by the arrival
        running = during >= 0 and calls[during].end > r.arrival
        boundary = r.handed_over - r.arrival
        rows.append({"request_id": r.request_id, "ttft_ms": 1e3 * ttft,
                     "ttft_wall_ms": 1e3 * (r.first_output - r.arrival), "boundary_ms": 1e3 * boundary,
                     "after_boundary_ms": 1e3 * (ttft - boundary),
                     "queue_ms": 1e3 * (r.metrics["first_scheduled"] - r.arrival),
                     "window_at_arrival": calls[during].window if running else None,
                     "windows_to_first_token": [c.window for c in calls[r.handed_over_call:r.first_output_call + 1]],
                     "calls_to_first_token_ms": [round(1e3 * (c.end - c.start), 2)
                                                 for c in calls[r.handed_over_call:r.first_output_call + 1]],
                     "flood_unfinished": r.flood_unfinished,
                     "decode_step_ms": 1e3 * r.decode_step_s if r.decode_step_s else None})
    summary = {f"{key}_{name}": value for key in ("ttft_ms", "boundary_ms", "after_boundary_ms")
               for name, value in percentiles([row[key] for row in rows]).items()}
    return {**summary, "after_boundary_within_50ms": sum(row["after_boundary_ms"] <= 50 for row in rows),
            "arrived_during_flood": sum(row["flood_unfinished"] > 0 for row in rows), "steps": len(calls),
            "requests": rows}


def percentiles(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"p50": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def late_prompts(args, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed + 1)  # not the flood's draws
    return [[rng.randrange(100, vocab_size - 100) for _ in range(args.late_input_len)] for _ in range(args.num_late)]


def run_pass(engine, name: str, flood, prompts, args) -> dict:
    """One pass: the late requests into ``engine`` with ``flood`` (or none) running."""
    late = [LateRequest(f"late-{name}-{k}", p) for k, p in enumerate(prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.late_output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    windows_before = engine.window_steps.copy()
    with TritonCompileWatch() as builds:
        began = time.perf_counter()
        calls, profiled = drive(engine, flood, late, params, args.late_start, args.late_interval, cache_salt=name,
                                profiled=args.profile_late if flood else None)
        seconds = time.perf_counter() - began
    return {**report(late, calls), "seconds": seconds, **({"profile": profiled} if profiled else {}),
            "window_steps": {str(k): v for k, v in sorted((engine.window_steps - windows_before).items())},
            "decode_step_ms": 1e3 * (engine.decode_step_seconds or 0),
            "triton_builds": builds.report()}


def print_pass(name: str, res: dict) -> None:
    print(f"{name}: TTFT p50 {res['ttft_ms_p50']:.1f} ms, p99 {res['ttft_ms_p99']:.1f} ms; to the step boundary "
          f"p50 {res['boundary_ms_p50']:.1f} ms, p99 {res['boundary_ms_p99']:.1f} ms; after it p50 "
          f"{res['after_boundary_ms_p50']:.1f} ms, p99 {res['after_boundary_ms_p99']:.1f} ms "
          f"({res['after_boundary_within_50ms']}/{len(res['requests'])} within 50 ms; "
          f"{res['arrived_during_flood']} arrived during the flood)")
    print(f"  {res['steps']} step() calls in {res['seconds']:.2f} s; decode windows (steps: launches) "
          f"{res['window_steps']}, decode step {res['decode_step_ms']:.2f} ms; "
          f"Triton builds {res['triton_builds']['count']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)  # the flood: --num-prompts requests, drawn as throughput.py draws them
    parser.add_argument("--num-late", type=int, default=16)
    parser.add_argument("--late-input-len", type=int, default=128)
    parser.add_argument("--late-output-len", type=int, default=16)
    parser.add_argument("--late-start", type=float, default=0.25,
                        help="seconds from the moment no flood request waits to the first late arrival")
    parser.add_argument("--late-interval", type=float, default=0.25, help="seconds between late arrivals")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: flood + late requests")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-space", type=float, default=4.0, help="GiB of KV cache on CPU")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--num-scheduler-steps", type=int, default=None,
                        help="fixed decode windows (default: the engine sizes them itself on a GPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile-late", type=int, default=None, metavar="K",
                        help="profile the calls from the flood pass's K-th late request's hand-over to its first token (GPU)")
    parser.add_argument("--output-json", default=None)
    add_engine_knob_args(parser)
    args = parser.parse_args()
    apply_engine_knobs(args)
    if args.max_num_seqs is None:
        args.max_num_seqs = args.num_prompts + args.num_late

    from inference.model_loader import load_hf_config, resolve_model
    vocab = load_hf_config(resolve_model(args.model, load_format=args.load_format).model_dir).vocab_size
    prompts, outputs = make_workload(args, vocab)
    late = late_prompts(args, vocab)
    llm = make_llm(args, args.num_scheduler_steps)
    engine = llm.llm_engine
    warm_up(llm, prompts)
    llm.generate(prompt_token_ids=late[:1], use_tqdm=False,  # the late shape alone (no salt: no pass hits it)
                 sampling_params=SamplingParams(max_tokens=2, ignore_eos=True))
    flood = [(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, outputs)]
    during = run_pass(engine, "flood", flood, late, args)
    print_pass("during the flood", during)
    idle = run_pass(engine, "idle", [], late, args)
    print_pass("idle engine     ", idle)
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
              "workload": {"model": args.model, "flood": args.workload, "num_prompts": len(prompts),
                           "input_tokens": sum(map(len, prompts)), "requested_output_tokens": sum(outputs),
                           "num_late": args.num_late, "late_input_len": args.late_input_len,
                           "late_output_len": args.late_output_len, "late_start_s": args.late_start,
                           "late_interval_s": args.late_interval},
              "max_num_seqs": args.max_num_seqs, "num_scheduler_steps": args.num_scheduler_steps or "auto",
              "adaptive_windows": engine.config.scheduler.adaptive_windows,
              "max_window": engine.config.scheduler.num_scheduler_steps,
              "window_target_ms": 1e3 * decode_windows.WINDOW_TARGET_S, "window_clock": decode_windows.WINDOW_CLOCK,
              "async_scheduling": engine.config.scheduler.async_scheduling,
              "piecewise_graphs": getattr(engine.runner, "piecewise_graphs", None) is not None,
              "device": engine.config.device, "dtype": str(engine.config.dtype),
              "during_flood": during, "idle": idle,
              "ttft_p50_ratio": during["ttft_ms_p50"] / idle["ttft_ms_p50"],
              "ttft_p99_ratio": during["ttft_ms_p99"] / idle["ttft_ms_p99"]}
    write_result(result, args.output_json, f"late_requests_{args.model.replace('/', '_')}_{engine.config.device}.json")


if __name__ == "__main__":
    main()
