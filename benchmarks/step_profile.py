"""Where a step's time goes: host-side phase timers and a CUDA kernel table (benchmark-only).

``PhaseTimers(engine)`` wraps the engine's step phases (wait for the device, bookkeeping of
sampled tokens, schedule, prepare-and-launch, detokenize) with wall-clock accumulators, in
seconds; the engine's code is untouched. ``kernel_table(...)`` runs a callable under
``torch.profiler`` and returns the kernels that took the most device time. ``TritonCompileWatch``
counts the Triton kernel variants first built (or loaded from Triton's disk cache) while it is open;
``GcWatch`` the garbage collector's pauses.
"""
from __future__ import annotations

import gc
import time
from typing import Callable

import torch


class PhaseTimers:
    """Accumulated wall-clock seconds per phase of ``LLMEngine.step()``.

    ``finish_inflight`` includes the wait for the device (also reported as ``device_wait``);
    ``host_bookkeeping`` is the difference.
    """

    def __init__(self, engine) -> None:
        self.seconds: dict[str, float] = {}
        self._engine = engine
        self._wrap(engine, "_finish_inflight", "finish_inflight")
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "execute_async", "prepare_and_launch")
        self._wrap(engine.output_processor, "process", "detokenize")
        # inside prepare_and_launch
        from inference.runner import model_runner
        from inference.sampling import SamplingMetadata
        runner = engine.runner
        self._wrap(model_runner, "host_batch", "launch.host_batch")
        self._wrap(model_runner, "device_inputs", "launch.device_inputs")
        self._wrap(SamplingMetadata, "from_requests", "launch.sampling_metadata")
        self._wrap(model_runner, "StepHandle", "launch.step_handle")
        self._wrap(runner, "sampler", "launch.sampler")
        self._wrap(runner.model, "forward", "launch.eager_forward")
        self._wrap(runner.model, "compute_logits", "launch.compute_logits")
        if runner.graph_runner is not None:
            self._wrap(runner.graph_runner, "run", "launch.graph_replay")

    def _wrap(self, owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)
        self.seconds[name] = 0.0

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        setattr(owner, attr, timed)

    def report(self) -> dict[str, float]:
        out = dict(self.seconds)
        out["device_wait"] = self._engine.device_wait_seconds
        out["host_bookkeeping"] = out["finish_inflight"] - out["device_wait"]
        return {k: round(v, 4) for k, v in out.items()}


class TritonCompileWatch:
    """Context manager: each Triton kernel variant the process builds while open, and its wall seconds.

    A variant is built on an in-process cache miss: a kernel's first call with a new specialization
    (constexprs, dtypes, integer arguments equal to 1 or divisible by 16, pointer alignment), compiled
    or loaded from Triton's on-disk cache. Inside a timed run each one is a stall of the step that hit
    it. Uses ``triton.knobs.runtime.jit_cache_hook`` and ``jit_post_compile_hook``; without Triton it
    records nothing.
    """

    def __init__(self) -> None:
        self.builds: list[tuple[str, float]] = []
        self.examples: dict[str, list[str]] = {}  # up to 3 variant signatures per kernel
        self._started: tuple[str, float] | None = None
        self._saved = None

    def __enter__(self) -> "TritonCompileWatch":
        try:
            from triton import knobs
        except ImportError:
            return self
        runtime = knobs.runtime
        self._saved = (runtime, runtime.jit_cache_hook, runtime.jit_post_compile_hook)

        def before(*, fn, repr, **_) -> bool:  # noqa: A002 - Triton's keyword
            seen = self.examples.setdefault(fn.name, [])
            if len(seen) < 3:
                seen.append(repr)
            self._started = (fn.name, time.perf_counter())
            return False  # build it

        def after(*, fn, **_) -> None:
            name, start = self._started if self._started else (fn.name, time.perf_counter())
            self.builds.append((name, time.perf_counter() - start))
            self._started = None
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
        return self

    def __exit__(self, *exc) -> None:
        if self._saved:
            runtime, runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._saved

    def report(self) -> dict:
        """``{"count", "seconds", "kernels": {name: count}, "examples"}`` of the variants built while open."""
        kernels: dict[str, int] = {}
        for name, _ in self.builds:
            kernels[name] = kernels.get(name, 0) + 1
        return {"count": len(self.builds), "seconds": round(sum(s for _, s in self.builds), 3), "kernels": kernels,
                "examples": self.examples}


class GcWatch:
    """Context manager: the cyclic garbage collector's collections while open, by generation, with their pause
    (``gc.callbacks``), in milliseconds."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []  # (generation, seconds)
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def start(self) -> "GcWatch":
        gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)

    def __enter__(self) -> "GcWatch":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def report(self) -> dict:
        """``{"threshold", "collections": {generation: count}, "ms", "max_ms"}``."""
        counts: dict[str, int] = {}
        for generation, _ in self.pauses:
            counts[str(generation)] = counts.get(str(generation), 0) + 1
        seconds = [s for _, s in self.pauses]
        return {"threshold": list(gc.get_threshold()), "collections": counts, "ms": round(1e3 * sum(seconds), 2),
                "max_ms": round(1e3 * max(seconds, default=0.0), 2)}


def device_timeline(prof, wall_s: float) -> dict:
    """How busy the device was between the profiled run's first and last kernel: the union of kernel
    intervals against that span, and the idle gaps between kernels (the host not keeping it fed)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return {"wall_ms": wall_s * 1e3}
    busy, gaps = 0.0, []
    cur_start, cur_end = spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append(start - cur_end)
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = spans[-1][1] - spans[0][0] if spans else 0.0
    span = max(span, cur_end - spans[0][0])
    long = [g for g in gaps if g > 20]
    return {"wall_ms": round(wall_s * 1e3, 3), "device_span_ms": round(span / 1e3, 3),
            "device_busy_ms": round(busy / 1e3, 3), "busy_fraction": round(busy / span, 4) if span else None,
            "gaps_over_20us": {"count": len(long), "ms": round(sum(long) / 1e3, 3)},
            "gaps_all_ms": round(sum(gaps) / 1e3, 3), "largest_gaps_us": [round(g, 1) for g in sorted(gaps)[-10:]]}


def kernel_table(fn: Callable[[], None], top: int = 25) -> dict:
    """Run ``fn`` under the profiler; the ``top`` kernels by total device time (ms) and their share. Without
    CUDA, the ``top`` operators by self CPU time (ms) and their share of the wall time."""
    from torch.profiler import ProfilerActivity, profile
    on_gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
        started = time.perf_counter()
        fn()
        if on_gpu:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - started
    if not on_gpu:
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        return {"wall_ms": round(wall_s * 1e3, 3),
                "host_ops_self": [{"name": e.key[:120], "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 3),
                                   "share_of_wall": round(e.self_cpu_time_total / 1e6 / wall_s, 4)} for e in events]}
    return profile_summary(prof, wall_s, top)


def profile_summary(prof, wall_s: float, top: int = 25) -> dict:
    """A finished ``torch.profiler.profile`` of ``wall_s`` seconds: the ``top`` kernels by total device time (ms)
    and their share, the device's busy timeline, and the host's most expensive operations (self time, ms)."""
    events = prof.key_averages()
    runtime = sorted((e for e in events if e.key.startswith(("cuda", "cu"))), key=lambda e: e.self_cpu_time_total,
                     reverse=True)[:12]
    rows = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
            or getattr(e, "self_device_time_total", 0) > 0]
    rows.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in rows) or 1.0
    return {"device_ms_total": total / 1000, "timeline": device_timeline(prof, wall_s),
            "kernels": [{"name": e.key[:120], "calls": e.count, "device_ms": round(e.self_device_time_total / 1000, 3),
                         "share": round(e.self_device_time_total / total, 4)} for e in rows[:top]],
            "runtime_calls_host_ms": {e.key: round(e.self_cpu_time_total / 1000, 3) for e in runtime},
            "host_ops_self_ms": {e.key: round(e.self_cpu_time_total / 1000, 3) for e in sorted(
                events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]}}
