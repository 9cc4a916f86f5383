"""Offline throughput: Tessera's engine against Hugging Face transformers, side by side.

Both run on identical random token-id prompts in the same process. Throughput counts each
request's requested output tokens only (ignore_eos), so what transformers' static batch
computes past a request's own max_tokens is waste, not output.

    python benchmarks/throughput.py                       # CPU workload: SmolLM2, 64 prompts, lengths U[16, 256]
    python benchmarks/throughput.py --input-len 1024 --output-len 512 --num-prompts 256 \
        --model qwen2.5-7b --load-format dummy --dtype bfloat16   # GPU workload W1 (performance issue)
    python benchmarks/throughput.py --workload peer-w2 --num-prompts 256 --model qwen2.5-0.5b \
        --load-format dummy --dtype bfloat16 --num-scheduler-steps 1 4 8   # W2, one engine per N, in turn
    python benchmarks/throughput.py --num-prompts 1 --input-len 128 --output-len 64 --rounds 10
                                                          # CPU single stream: LLM.generate against generate,
                                                          # alternating rounds

Writes JSON (figures and the exact command) to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import shlex
import sys
import time
from pathlib import Path

import torch

from provenance import current_commit
from step_profile import GcWatch, PhaseTimers, TritonCompileWatch, kernel_table
from transformers_peer import run_alternating, run_transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import LLM, SamplingParams  # noqa: E402
from inference.sampling_params import RequestOutputKind  # noqa: E402
from inference.sched import decode_windows  # noqa: E402
from engine_knobs import add_engine_knob_args, apply_engine_knobs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def make_workload(args, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """Random token-id prompts. ``--workload peer-w1|peer-w2`` draws exactly the prompts of the transformers
    peer scripts (shared/peer/hf_peer.py, hf_peer_w2.py) with their seeds, so both run identical inputs."""
    if args.workload == "peer-w1":
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(100, vocab_size - 100, (args.input_len,), generator=g).tolist()
                   for _ in range(args.num_prompts)]
        return prompts, [args.output_len] * args.num_prompts
    rng = random.Random(args.seed)
    if args.workload == "peer-w2":  # nano-vllm's workload: lengths uniform in [100, 1024]
        pairs = [([rng.randint(100, vocab_size - 100) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024))
                 for _ in range(args.num_prompts)]
        return [p for p, _ in pairs], [n for _, n in pairs]

    def length(fixed, low, high):
        return fixed if fixed else rng.randint(low, high)

    prompts, outputs = [], []
    for _ in range(args.num_prompts):
        prompts.append([rng.randrange(100, vocab_size - 100) for _ in range(length(args.input_len, args.min_len, args.max_len))])
        outputs.append(length(args.output_len, args.min_len, args.max_len))
    return prompts, outputs


OCCUPANCY_EVERY = 8  # steps between KV-slot occupancy samples once every prompt is admitted


def make_llm(args, num_scheduler_steps: int | None = None) -> LLM:
    """The engine under test, built from the command line (shared by the measured and the profiled run)."""
    return LLM(model=args.model, dtype=args.dtype, load_format=args.load_format, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               kv_cache_space=args.kv_cache_space, enforce_eager=args.enforce_eager,
               async_scheduling=getattr(args, "async_scheduling", None),
               enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
               quantization=getattr(args, "quantization", None),
               kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
               tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
               num_scheduler_steps=num_scheduler_steps, **getattr(args, "lora_engine_kwargs", {}))


def warm_up(llm, prompts, count: int = 16, loras: list | None = None) -> None:
    """Generate a few tokens for the first ``2 * count + 1`` prompts, so that every kernel variant of the
    timed run is compiled before the clock starts: a full prefill chunk (W1: 16 prompts of 1,024 tokens),
    decode steps, a chunk that mixes decodes with prefills, one of them cut at the token budget and finished
    in the next step (the prefill kernel's cached-context variant), and with multi-step scheduling whole
    windows of ``num_scheduler_steps`` decodes. With one full chunk and 2 tokens, W1 with FP8 run first in a
    device call had a median TTFT of 3.2-3.4 s against 2.2 s once another run had filled Triton's cache
    (2.21 s with this warm-up). The multi-step windows keep Triton builds out of multi-step runs too;
    ``triton_builds_in_timed_run`` in the result reports any build left. The warm-up's prompts are
    cached under their own ``cache_salt``: the timed run, which reuses them, finds none of their blocks
    (prefix caching is on by default), so its hit rate is its own. ``loras``: the LoRA adapters the timed run
    spreads its requests over (``LoRARequest``s), in turn.
    """
    steps = llm.llm_engine.config.scheduler.num_scheduler_steps
    llm.generate(prompt_token_ids=prompts[:2 * count + 1], use_tqdm=False, cache_salt="warm-up",
                 sampling_params=SamplingParams(max_tokens=2 + 3 * steps if steps > 1 else 2, ignore_eos=True),
                 lora_request=_lora_of(loras, len(prompts[:2 * count + 1])) if loras else None)


def _lora_of(loras: list, count: int) -> list:
    """The adapters of requests ``0..count-1``, taken from ``loras`` in turn (one adapter per request)."""
    return [loras[i % len(loras)] for i in range(count)]


def run_tessera(args, prompts, outputs, num_scheduler_steps: int | None = None) -> dict:
    """Drive the engine step by step: throughput, per-request TTFT/TPOT, and KV slot occupancy.

    With ``--repeat R`` the same engine then runs the workload R - 1 more times; their throughputs go
    into ``repeats`` (the first run's figures stay the result), which separates what a first run pays
    once (kernel variants built, caches filled) from the steady state.
    """
    built = time.perf_counter()
    llm = make_llm(args, num_scheduler_steps)
    build_s = time.perf_counter() - built  # weights, KV cache, CUDA graphs (and window graphs)
    engine = llm.llm_engine
    kind = RequestOutputKind[getattr(args, "output_kind", "final_only").upper()]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=kind) for n in outputs]
    loras = getattr(args, "lora_requests", None)
    warm_up(llm, prompts, loras=loras)
    result = timed_run(engine, prompts, outputs, params, getattr(args, "phase_timers", False), "",
                       getattr(args, "step_trace", False), loras)
    result["repeats"] = [timed_run(engine, prompts, outputs, params, False, f"r{r}-", loras=loras)["output_tokens_per_s"]
                         for r in range(1, getattr(args, "repeat", 1))]
    windows, blas = engine.runner.window_graphs, engine.runner.blas_choice
    result.update({"engine_build_s": build_s, "window_graphs": windows is not None,
                   "window_graph_lengths": windows.lengths if windows is not None else [],
                   "window_clock": decode_windows.WINDOW_CLOCK, "window_host_cover": decode_windows.HOST_COVER,
                   "blas_library": str(torch.backends.cuda.preferred_blas_library()) if torch.cuda.is_available() else None,
                   "blas_choice_lt_rows": blas.lt_rows if blas else None, "blas_choice_saving": blas.saving if blas else None,
                   "piecewise_graphs": getattr(engine.runner, "piecewise_graphs", None) is not None,
                   "graph_memory_GiB": engine.runner.graph_memory_bytes / 2**30,
                   "num_scheduler_steps": num_scheduler_steps or "auto",
                   "window_steps": {str(k): v for k, v in sorted(engine.window_steps.items())},
                   "decode_step_ms": 1e3 * (engine.decode_step_seconds or 0),
                   "host_ms_per_decode_iteration": {str(k): 1e3 * v for k, v in
                                                    sorted(engine.decode_clock.host_seconds.items())},
                   "output_kind": kind.name.lower(),
                   "weights_bytes": engine.runner.weights_bytes,
                   "kv_bytes_per_token": engine.runner.bytes_per_block // engine.config.cache.block_size,
                   "kv_cache_dtype": engine.config.cache.cache_dtype, "num_gpu_blocks": engine.runner.num_blocks,
                   "kv_cache_tokens": engine.runner.num_blocks * engine.config.cache.block_size,
                   "hf_config": engine.config.hf_config, "hf_model_dir": engine.config.model_dir,
                   "device": engine.config.device, "dtype": str(engine.config.dtype)})
    return result


def timed_run(engine, prompts, outputs, params, phase_timers: bool, id_prefix: str, step_trace: bool = False,
              loras: list | None = None) -> dict:
    """One timed pass of the workload through ``engine``: its throughput, latencies and KV occupancy.

    ``step_trace`` adds where the wall time went by batch size (:func:`summarise_trace`); ``loras``: request
    ``i`` uses adapter ``loras[i % len(loras)]``.
    """
    produced, steps, occupancy, metrics, trace = 0, 0, [], {}, []
    engine.device_wait_seconds = 0.0
    windows_before, ahead_before = engine.num_multi_step_windows, engine.num_steps_ahead
    kv = engine.kv_cache_manager
    hits_before, queries_before = kv.prefix_cache_hits, kv.prefix_cache_queries
    timers = PhaseTimers(engine) if phase_timers else None
    with TritonCompileWatch() as builds, GcWatch() as collector:
        start = time.perf_counter()
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"{id_prefix}{i}", prompt, sp, lora_request=loras[i % len(loras)] if loras else None)
        decode_steps = []  # wall seconds of steps taken once every prompt is admitted
        admitted = False
        last = time.perf_counter()
        while engine.has_unfinished_requests():
            if step_trace:  # (rows running, waiting, device wait so far) before the step
                trace.append((len(engine.scheduler.running), engine.scheduler.num_waiting, engine.device_wait_seconds))
            for out in engine.step():
                produced += sum(len(o.token_ids) for o in out.outputs)
                if out.finished:
                    metrics[int(out.request_id[len(id_prefix):])] = out.metrics
            steps += 1
            now = time.perf_counter()
            # get_stats() walks every running request: every 8th step only once all are admitted, so that the
            # benchmark's own bookkeeping stays out of the step time it measures
            if not admitted or steps % OCCUPANCY_EVERY == 0:
                stats = engine.get_stats()
                admitted = stats.num_waiting == 0 and stats.num_allocated_slots > 0
                if admitted:
                    occupancy.append(stats.num_live_tokens / stats.num_allocated_slots)
            if admitted:
                decode_steps.append(now - last)
            if step_trace:
                trace[-1] += (now - last, engine.device_wait_seconds)
            last = now
        elapsed = time.perf_counter() - start
    assert produced == sum(outputs), "the engine produced a different number of tokens than requested"
    ttft = sorted(m["first_token"] - m["arrival"] for m in metrics.values())
    tpot = sorted((m["finished"] - m["first_token"]) / max(outputs[k] - 1, 1) for k, m in metrics.items())
    return {"seconds": elapsed, "output_tokens": produced, "output_tokens_per_s": produced / elapsed, "steps": steps,
            "device_wait_s": engine.device_wait_seconds,
            "median_step_ms_all_admitted": 1000 * sorted(decode_steps)[len(decode_steps) // 2] if decode_steps else None,
            "steps_launched_ahead": engine.num_steps_ahead - ahead_before,
            "prefix_cache_hit_tokens": kv.prefix_cache_hits - hits_before,
            "prefix_cache_query_tokens": kv.prefix_cache_queries - queries_before,
            "multi_step_windows": engine.num_multi_step_windows - windows_before,
            "triton_builds_in_timed_run": builds.report(), "gc_in_timed_run": collector.report(),
            "phase_seconds": timers.report() if timers else None,
            "median_ttft_s": ttft[len(ttft) // 2], "median_tpot_ms": 1000 * tpot[len(tpot) // 2],
            "p99_tpot_ms": 1000 * tpot[min(len(tpot) - 1, int(len(tpot) * 0.99))],
            "kv_slot_occupancy_min": min(occupancy, default=None),
            "kv_slot_occupancy_mean": sum(occupancy) / len(occupancy) if occupancy else None,
            **({"step_trace": summarise_trace(trace)} if step_trace else {})}


def summarise_trace(trace: list[tuple]) -> dict:
    """Wall and device-wait seconds of the ``engine.step()`` calls (a window of ``num_scheduler_steps``
    decode steps each) by the rows running when each call began: the calls while prompts still wait
    (``waiting``: prefill), then the others in bands of batch size. ``wait_s`` is the host blocked on the
    device; the rest of ``wall_s`` is host work, which the device's work may or may not have overlapped."""
    bands = [(0, 16), (16, 32), (32, 64), (64, 128), (128, 192), (192, 10**9)]
    out = {}
    for running, waiting, wait_before, wall, wait_after in trace:
        key = "waiting" if waiting else next(f"rows_{lo}-{hi - 1}" if hi < 10**9 else f"rows_{lo}+"
                                             for lo, hi in bands if lo <= running < hi)
        band = out.setdefault(key, {"steps": 0, "wall_s": 0.0, "wait_s": 0.0, "rows_x_steps": 0})
        band["steps"] += 1
        band["wall_s"] += wall
        band["wait_s"] += wait_after - wait_before
        band["rows_x_steps"] += running
    for band in out.values():
        band["ms_per_engine_step"] = 1e3 * band["wall_s"] / band["steps"]
        band["mean_rows"] = band.pop("rows_x_steps") / band["steps"]
    return out


def profile_steps(args, prompts, outputs) -> dict:
    """Kernel table of ``--profile-steps`` steps: from the first step (``--profile-phase prefill``) or
    once every prompt has been prefilled (``decode``)."""
    llm = make_llm(args, (getattr(args, "num_scheduler_steps", None) or [None])[0])
    engine = llm.llm_engine
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    loras = getattr(args, "lora_requests", None)
    warm_up(llm, prompts, loras=loras)
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, param, lora_request=loras[i % len(loras)] if loras else None)
    if args.profile_phase == "decode":
        while engine.scheduler.num_waiting:
            engine.step()
        for _ in range(3):
            engine.step()

    def run() -> None:
        for _ in range(args.profile_steps):
            engine.step()
    table = kernel_table(run)
    table["steps"], table["phase"] = args.profile_steps, args.profile_phase
    table["running"] = engine.get_stats().num_running
    return table


def roofline(ours: dict, prompts, outputs, copy_gbps: float, matmul_tflops: float) -> dict:
    """Lower bound of the run's time: prefill FLOPs at the matmul rate, plus decode at the slower of its FLOPs
    and its bytes (all weights once per decode step, at least max(outputs) steps; each output token reads its
    whole context's K/V once) at the copy bandwidth."""
    cfg = ours.pop("hf_config")
    n_params = ours["weights_bytes"] / (2 if "16" in ours["dtype"] else 4)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim  # QK^T and PV FLOPs per (query, key)
    prefill_flops = sum(2 * n_params * len(p) + attn * len(p) * (len(p) + 1) / 2 for p in prompts)
    decode_flops = sum(2 * n_params * n + attn * (n * len(p) + n * (n - 1) / 2) for p, n in zip(prompts, outputs))
    kv_bytes = ours["kv_bytes_per_token"] * sum(n * len(p) + n * (n + 1) / 2 for p, n in zip(prompts, outputs))
    decode_bytes = ours["weights_bytes"] * max(outputs) + kv_bytes
    bound = prefill_flops / (matmul_tflops * 1e12) + max(decode_flops / (matmul_tflops * 1e12),
                                                           decode_bytes / (copy_gbps * 1e9))
    return {"copy_GBps": copy_gbps, "matmul_TFLOPs": matmul_tflops, "prefill_TFLOP": prefill_flops / 1e12,
            "decode_TFLOP": decode_flops / 1e12, "decode_GB": decode_bytes / 1e9, "lower_bound_s": bound,
            "fraction_of_roofline": bound / ours["seconds"]}


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The model and the random workload's lengths, shared with the benchmarks that draw workloads here."""
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=0, help="fixed prompt length (0: uniform in [min, max])")
    parser.add_argument("--output-len", type=int, default=0, help="fixed output length (0: uniform in [min, max])")
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--workload", choices=["random", "peer-w1", "peer-w2"], default="random")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags that ``make_llm`` reads (but ``--num-scheduler-steps``), the seed and the roofline's
    rates, shared with the benchmarks that run ``run_tessera``."""
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-space", type=float, default=4.0)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="prefix caching (on by default, as the engine)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--quantization", "-q", default=None, help="awq | gptq | fp8 (dummy weights: random packed)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 | fp8_e4m3 (the KV cache's storage)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--copy-gbps", type=float, default=4250.0, help="measured copy bandwidth (roofline)")
    parser.add_argument("--matmul-tflops", type=float, default=790.0, help="measured bf16 matmul rate (roofline)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    add_engine_knob_args(parser)
    add_engine_args(parser)
    parser.add_argument("--num-scheduler-steps", type=int, nargs="+", default=[None], metavar="N",
                        help="decode steps per host iteration (multi-step scheduling; default: the engine "
                             "sizes windows itself); several values run one engine per value, in turn")
    parser.add_argument("--peer", choices=["transformers", "none"], default="transformers")
    parser.add_argument("--peer-batch-size", type=int, default=0, help="static batch size (0: all prompts)")
    parser.add_argument("--phase-timers", action="store_true", help="report host seconds per step phase")
    parser.add_argument("--step-trace", action="store_true",
                        help="report wall and device-wait seconds by batch size (rows running at each step)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="instead of the measured run: a CUDA kernel table of this many steps (on a CPU, the "
                             "operators by self time)")
    parser.add_argument("--profile-phase", choices=["decode", "prefill"], default="decode",
                        help="profile from the first step (prefill) or once all prompts are prefilled (decode)")
    parser.add_argument("--output-kind", choices=["final_only", "delta"], default="final_only",
                        help="SamplingParams.output_kind of the measured requests: one output per request, as "
                             "LLM.generate (and vLLM's throughput benchmark) asks for, or every step's deltas")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the workload this many times on the same engine (the first is the result)")
    parser.add_argument("--rounds", type=int, default=0,
                        help="instead of the step-by-step run: this many alternating rounds of LLM.generate and "
                             "transformers' generate over the whole workload (run_alternating)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    apply_engine_knobs(args)

    from inference.model_loader import load_hf_config, resolve_model
    vocab = load_hf_config(resolve_model(args.model, load_format=args.load_format).model_dir).vocab_size
    prompts, outputs = make_workload(args, vocab)
    commit = current_commit()
    result = {"command": "python " + shlex.join(sys.argv), "commit": commit or None,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
              "workload": {"model": args.model, "num_prompts": len(prompts), "input_tokens": sum(map(len, prompts)),
                           "requested_output_tokens": sum(outputs)}}
    if args.profile_steps:  # a run of its own: the profiler's overhead would distort the figures
        result["kernel_profile"] = prof = profile_steps(args, prompts, outputs)
        if "kernels" in prof:
            for k in prof["kernels"][:15]:
                print(f"  {100 * k['share']:5.1f}% {k['device_ms']:9.1f} ms {k['calls']:6d}x {k['name'][:90]}")
            print("  CUDA runtime calls, host ms:", prof["runtime_calls_host_ms"])
            print("  host ops, self ms:", prof["host_ops_self_ms"])
            print("  device timeline:", prof["timeline"])
        else:  # CPU: operators by self time
            print(f"  {prof['wall_ms']:.0f} ms over {args.profile_steps} steps")
            for k in prof["host_ops_self"][:15]:
                print(f"  {100 * k['share_of_wall']:5.1f}% {k['self_ms']:9.1f} ms {k['calls']:6d}x {k['name'][:90]}")
        Path(args.output_json or RESULTS / "kernel_profile.json").write_text(json.dumps(result, indent=2) + "\n")
        return
    if args.rounds:
        result["alternating"] = alt = run_alternating(make_llm(args), args.rounds, prompts, outputs)
        print(f"median Tessera {alt['tessera_median']:.2f}, transformers {alt['transformers_median']:.2f} output "
              f"tok/s: {alt['ratio']:.2f}x")
        write_result(result, args.output_json, f"alternating_{args.model.replace('/', '_')}_{alt['device']}.json")
        return
    for index, num_steps in enumerate(args.num_scheduler_steps):
        ours = run_tessera(args, prompts, outputs, num_steps)
        roof = roofline(ours, prompts, outputs, args.copy_gbps, args.matmul_tflops)
        if index == 0:
            result["tessera"], result["roofline"] = ours, roof
        if len(args.num_scheduler_steps) > 1:
            result.setdefault("by_num_scheduler_steps", {})[str(num_steps)] = {"tessera": ours, "roofline": roof}
        print_tessera(ours, roof)
        gc.collect()  # the engine's memory goes back before the next one sizes its KV cache
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    ours = result["tessera"]
    if args.peer == "transformers":
        dtype = ours["dtype"].replace("torch.", "")
        peer = run_transformers(ours["hf_model_dir"], ours["device"], dtype, prompts, outputs,
                                args.peer_batch_size or len(prompts))
        result["transformers_generate"] = peer
        result["ratio"] = ours["output_tokens_per_s"] / peer["output_tokens_per_s"]
        for run in result.get("by_num_scheduler_steps", {}).values():
            run["ratio"] = run["tessera"]["output_tokens_per_s"] / peer["output_tokens_per_s"]
        print(f"transformers: {peer['output_tokens_per_s']:10.1f} output tok/s ({peer['seconds']:.1f} s)")
        print(f"ratio:        {result['ratio']:10.2f}x")
    write_result(result, args.output_json, f"throughput_{args.model.replace('/', '_')}_{ours['device']}.json")


def print_tessera(ours: dict, roof: dict) -> None:
    print(f"Tessera:      {ours['output_tokens_per_s']:10.1f} output tok/s ({ours['seconds']:.1f} s, {ours['steps']} steps, "
          f"num_scheduler_steps={ours['num_scheduler_steps']}: {ours['multi_step_windows']} multi-step windows)")
    print(f"  median TTFT {ours['median_ttft_s']:.3f} s, median TPOT {ours['median_tpot_ms']:.2f} ms, "
          f"P99 TPOT {ours['p99_tpot_ms']:.2f} ms; median step once all are admitted "
          f"{ours['median_step_ms_all_admitted']:.2f} ms; {ours['steps_launched_ahead']} steps launched ahead")
    builds = ours["triton_builds_in_timed_run"]
    print(f"  Triton kernel variants built inside the timed run: {builds['count']} ({builds['seconds']:.2f} s) "
          f"{builds['kernels']}")
    collector = ours["gc_in_timed_run"]
    print(f"  garbage collections in the timed run: {collector['collections']} ({collector['ms']:.1f} ms, longest "
          f"{collector['max_ms']:.1f} ms; thresholds {collector['threshold']})")
    if ours["repeats"]:
        print("  repeats on the same engine, output tok/s:", [round(x) for x in ours["repeats"]])
    if ours["phase_seconds"]:
        print("  host seconds per phase:", ours["phase_seconds"])
    if ours["kv_slot_occupancy_min"] is not None:
        print(f"  KV slots holding live tokens while nothing waits: min {100 * ours['kv_slot_occupancy_min']:.1f}%, "
              f"mean {100 * ours['kv_slot_occupancy_mean']:.1f}%")
    print(f"  roofline lower bound {roof['lower_bound_s']:.2f} s ({roof['copy_GBps']:.0f} GB/s, "
          f"{roof['matmul_TFLOPs']:.0f} TFLOP/s): {100 * roof['fraction_of_roofline']:.0f}% of it")


def write_result(result: dict, output_json: str | None, default_name: str) -> None:
    """Write ``result`` as JSON to ``output_json``, or to ``benchmarks/results/<default_name>``."""
    RESULTS.mkdir(exist_ok=True)
    path = Path(output_json) if output_json else RESULTS / default_name
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
