"""Host time of a decode step with many running requests (the W2 shape's bottleneck), on CPU.

A tiny random Qwen2 model (Qwen2.5's tokenizer, a 2048-token vocabulary, one layer of width 32)
makes the forward pass cheap, so that a step's wall time is mostly the engine's Python work:
scheduling, building the model inputs and sampling metadata, appending tokens, stop checks,
detokenization and output objects. The forward pass (model, logits and sampler) is timed on its
own and subtracted, so ``host_ms_per_step`` is what the host spends per step besides the device's
work (on a GPU those calls only launch kernels, or replay a CUDA graph). Times are the process's
CPU time (``time.process_time``), so other load on a shared machine does not inflate them.

    python benchmarks/host_overhead.py                          # 256 requests, prompts 100..128, 96 outputs
    python benchmarks/host_overhead.py --profile 40             # plus a cProfile of 40 decode steps
                                                                # (and Python calls per step)
    python benchmarks/host_overhead.py --tag after-persistent   # result file suffix
    python benchmarks/host_overhead.py --num-scheduler-steps 8  # multi-step: compare host_us_per_token
    python benchmarks/host_overhead.py --output-range 100 1024 --output-kind final_only --num-scheduler-steps 8
                                                                # W2's output lengths: requests finish
                                                                # throughout (host_us_per_token_all_steps)

Also reports the Triton backend's input building (``host_batch`` + ``device_inputs``, the H200
path) for the same decode batch, timed alone on CPU tensors. Writes JSON (figures and the exact
command) to ``benchmarks/results/host_overhead_<tag>.json``.
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import platform
import pstats
import random
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import LLM, SamplingParams  # noqa: E402
from inference.sampling_params import RequestOutputKind  # noqa: E402
from inference.model_loader.dummy_models import dummy_model_dir  # noqa: E402
from step_profile import GcWatch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# CPU seconds of this process: on a shared machine, other processes' load does not count.
# The work is all on this thread (one torch thread, single-sequence Rust decodes).
CLOCK = time.process_time

TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "torch_dtype": "float32", "tie_word_embeddings": True, "vocab_size": 2048,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 1, "max_position_embeddings": 4096, "bos_token_id": 151643, "eos_token_id": 151643,
}


def tiny_model_dir(folder: Path) -> Path:
    """A config-only Qwen2 directory (random weights with ``load_format="dummy"``) with Qwen2.5's tokenizer."""
    source = dummy_model_dir("qwen2.5-0.5b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    (folder / "config.json").write_text(json.dumps(TINY_QWEN2))
    return folder


class Timers:
    """Accumulated seconds per wrapped method (the engine's code is untouched)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)
        self.seconds[name] = 0.0

        def timed(*args, **kwargs):
            start = CLOCK()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] += CLOCK() - start
        setattr(owner, attr, timed)


def phase_timers(engine) -> Timers:
    """Timers of the device's work (``forward``: model, logits, sampler) and of the step's host phases."""
    timers = Timers()
    runner, scheduler = engine.runner, engine.scheduler
    for owner, attr in ((runner.model, "forward"), (runner.model, "compute_logits"), (runner, "sampler")):
        timers.wrap(owner, attr, f"forward.{attr}")
    for owner, attr in ((engine, "_finish_inflight"), (engine.output_processor, "process"),
                        (scheduler, "can_schedule_ahead"), (scheduler, "schedule_ahead"), (scheduler, "update_from_output"),
                        (scheduler, "schedule"), (runner, "execute_async")):
        timers.wrap(owner, attr, attr)
    return timers


def triton_input_ms(engine, repeats: int = 50) -> float:
    """Milliseconds to build the Triton backend's inputs of the current decode batch (CPU tensors)."""
    from inference.runner.input_batch import device_inputs, host_batch
    sched_out = engine._inflight[0]  # the decode step in flight: every running request, one token each
    block_size = engine.config.cache.block_size
    start = CLOCK()
    for _ in range(repeats):
        device_inputs(host_batch(sched_out, block_size, ahead=True), block_size, "cpu", "triton")
    elapsed = (CLOCK() - start) / repeats
    return 1000 * elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-input", type=int, default=100)
    parser.add_argument("--max-input", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--output-range", nargs=2, type=int, default=None, metavar=("LO", "HI"),
                        help="each request's max_tokens uniform in [LO, HI] instead of --output-len")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--profile", type=int, default=0, help="cProfile this many decode steps")
    parser.add_argument("--profile-sort", default="tottime", choices=["tottime", "cumulative"],
                        help="order of the profile's 30 rows: own time, or time including callees")
    parser.add_argument("--tag", default="run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--num-scheduler-steps", type=int, default=1, help="decode steps per host iteration")
    parser.add_argument("--output-kind", choices=["delta", "final_only"], default="delta",
                        help="SamplingParams.output_kind: every step's deltas, or one output per request at the end")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # the shared 2-core machine: one thread keeps the forward's time steady

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 2000) for _ in range(rng.randint(args.min_input, args.max_input))]
               for _ in range(args.num_prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model=str(tiny_model_dir(Path(tmp))), load_format="dummy", dtype="float32", device="cpu",
                  max_model_len=2048 if args.output_range else 1024, max_num_seqs=args.num_prompts, max_num_batched_tokens=8192,
                  kv_cache_space=0.25, async_scheduling=args.async_scheduling,
                  num_scheduler_steps=args.num_scheduler_steps)
    engine = llm.llm_engine
    lengths = ([rng.randint(*args.output_range) for _ in prompts] if args.output_range
               else [args.output_len] * len(prompts))
    for i, (prompt, length) in enumerate(zip(prompts, lengths)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=length, ignore_eos=True,
                                                          output_kind=RequestOutputKind[args.output_kind.upper()]))
    texts: dict[str, str] = {}  # every output, so that runs with different step sizes compare

    counted = [engine.generation_tokens_total]

    def collect(outputs) -> int:
        """Join the outputs' text; the tokens generated by the step (FINAL_ONLY outputs come at the end)."""
        for out in outputs:
            for o in out.outputs:
                texts[out.request_id] = texts.get(out.request_id, "") + o.text
        num_tokens, counted[0] = engine.generation_tokens_total - counted[0], engine.generation_tokens_total
        return num_tokens
    while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        collect(engine.step())
    for _ in range(3):  # warm-up decode steps
        collect(engine.step())
    triton_ms = triton_input_ms(engine)
    timers = phase_timers(engine)
    profiler = cProfile.Profile() if args.profile else None
    steps, num_profiled = [], 0
    all_host, all_tokens = 0.0, 0  # every decode step, also those where requests finish
    forward_before, phases_before, phase_sums = 0.0, dict(timers.seconds), dict.fromkeys(timers.seconds, 0.0)
    collector = GcWatch().start()  # the collector's pauses over the measured steps
    while engine.has_unfinished_requests():
        full = len(engine.scheduler.running) == args.num_prompts
        profiled = profiler is not None and full and num_profiled < args.profile
        if profiled:
            num_profiled += 1
            profiler.enable()
        start = CLOCK()
        outputs = engine.step()
        wall = CLOCK() - start
        if profiled:
            profiler.disable()
        num_tokens = collect(outputs)
        forward_step = sum(v for k, v in timers.seconds.items() if k.startswith("forward.")) - forward_before
        if not profiled:
            all_host, all_tokens = all_host + wall - forward_step, all_tokens + num_tokens
        if full and not profiled and len(engine.scheduler.running) == args.num_prompts:
            forward_now = sum(v for k, v in timers.seconds.items() if k.startswith("forward."))
            steps.append((wall, forward_now - forward_before, num_tokens))
            for k, v in timers.seconds.items():
                phase_sums[k] += v - phases_before[k]
        forward_before = sum(v for k, v in timers.seconds.items() if k.startswith("forward."))
        phases_before = dict(timers.seconds)
    collector.stop()
    if not steps:
        sys.exit(f"no full-batch decode step was left to measure: --profile {args.profile} took them all "
                 "(with --output-range the first requests finish early; profile fewer steps)")
    steps.sort()
    median_wall = steps[len(steps) // 2][0]
    host = sorted(w - f for w, f, _ in steps)
    # a step returns up to num_scheduler_steps tokens per request: host time per generated token compares them
    per_token = sorted((w - f) / n for w, f, n in steps if n)
    num_tokens = sum(n for _, _, n in steps)
    result = {
        "command": "python " + shlex.join(sys.argv),
        "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
        "running_requests": args.num_prompts, "decode_steps_measured": len(steps),
        "async_scheduling": engine.config.scheduler.async_scheduling,
        "num_scheduler_steps": engine.config.scheduler.num_scheduler_steps,
        "tokens_per_step_mean": round(num_tokens / len(steps), 1),
        "host_us_per_token": round(1e6 * per_token[len(per_token) // 2], 3),
        "host_us_per_token_mean": round(1e6 * sum(host) / num_tokens, 3),
        "median_step_ms": round(1000 * median_wall, 3),
        "median_forward_ms": round(1000 * sorted(f for _, f, _ in steps)[len(steps) // 2], 3),
        "host_ms_per_step": round(1000 * host[len(host) // 2], 3),
        "host_s_all_steps": round(all_host, 3), "tokens_all_steps": all_tokens,
        "host_us_per_token_all_steps": round(1e6 * all_host / max(all_tokens, 1), 3),
        "host_ms_per_step_mean": round(1000 * sum(host) / len(host), 3),
        "phase_ms_per_step": {k: round(1000 * v / len(steps), 3) for k, v in phase_sums.items()},
        "triton_inputs_ms": round(triton_ms, 3),
        "gc": collector.report(),
        "output_text_sha256": hashlib.sha256(json.dumps(sorted(texts.items())).encode()).hexdigest()[:16],
    }
    if profiler is not None:
        stream = io.StringIO()
        stats = pstats.Stats(profiler, stream=stream)
        result["python_calls_per_step"] = round(stats.total_calls / num_profiled)  # noise-free proxy
        stats.sort_stats(args.profile_sort).print_stats(30)
        result["profile_top"] = stream.getvalue().splitlines()[:60]
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"host_overhead_{args.tag}.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "profile_top"}, indent=2))
    if profiler is not None:
        print("\n".join(result["profile_top"]))


if __name__ == "__main__":
    main()
