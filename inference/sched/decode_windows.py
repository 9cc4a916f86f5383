"""Multi-step scheduling: several decode steps per scheduling of a decode-only batch.

After vLLM's former ``--num-scheduler-steps N`` (vLLM v0 "multi-step scheduling"): when a step
is decode-only, the scheduler reserves KV slots for up to ``N`` tokens per request at once and
the model runner runs the steps back to back on the device, each step's sampled tokens being
the next step's inputs (:mod:`inference.runner.multi_step`). The host sees the ``N x batch``
tokens once, appends them request by request, applies the stop conditions token by token and
drops the tokens a request sampled after its finish. Scheduling, input building and the launch
are paid once per window instead of once per token.

A step stays a single step (today's behaviour) when:

* it computes anything but one sampled token per request: a prefill or prefill chunk, a
  recomputation after preemption, parallel samples forking from their prompt;
* it preempted a request, or a waiting request could be admitted (there is room under
  ``max_num_seqs``): admitting it one step later, not ``N`` steps later, keeps TTFT as it is;
* a request uses penalties, logprobs, or has not reached ``min_tokens`` (the sampler's input
  then changes with every token, which the device loop does not track);
* a request is one token from ``max_model_len`` (the window is cut to the shortest room left
  to ``max_model_len``, so no position passes it), or the KV pool cannot hold the window's
  slots of every request (no request is preempted for a window).

With async scheduling the next window is scheduled and launched while one is in flight
(:func:`rows_ahead`), its first inputs the last tokens of the window in flight, on the device.
"""
from __future__ import annotations

import collections
from collections.abc import Mapping

from ..kv_cache import KVCacheManager
from ..request import Request
from .scheduler_output import SchedulerOutput

MAX_SCHEDULER_STEPS = 64  # longest window (tokens of KV reserved ahead per request)
AUTO_MAX_WINDOW = 8  # longest window the engine chooses itself (no --num-scheduler-steps)
# Seconds an engine-sized window lasts at most: what a new request may wait (twice with the window launched
# ahead). On the H100, 12 ms against 25 ms: W2 3% slower (58,954 / 58,791 against 60,694 / 60,651 output tok/s,
# windows of 4 steps instead of 8) and late requests into W2 at p99 33.8-35.6 against 44.2 ms after the step
# boundary; W3 (7B, about 8.7 ms a step) unchanged, 8.68 against 8.69 ms median TPOT
# (late-requests-window-12ms_h100_2026-12-06.json, w2-window-*_h100_2026-12-06_*.json, w3*_h100_2026-12-06.json).
WINDOW_TARGET_S = 0.012
STEP_TIME_SMOOTHING = 0.2  # weight of the newest decode-step time in its moving average
# What a decode step's time is, where the device can time it: "device", the launch's own device time (CUDA events),
# or "wall", the time between the returns of consecutive launches (a benchmark knob; the CPU's only clock). Wall
# time counts the host's work per window too: a slow host measured longer steps and chose shorter windows, which cost
# it more. On the H200, W2 alternating device and wall clocks: 58,109 / 65,974 against 65,721 / 57,702 output tok/s
# (w2-window-clock-*_h200_2026-12-06_*.json; the slow run of each arm host-bound, the wall clock's with 2-step windows).
WINDOW_CLOCK = "device"
# With HOST_COVER > 0, where the device times its launches (CUDA, WINDOW_CLOCK "device"), a window also lasts at least
# HOST_COVER times the host's own time per decode-only iteration at that window length (processing a window's tokens,
# scheduling and launching the next, the caller's work on the outputs), up to the longest window: while a window's
# device time is shorter than that, the device waits for the host between windows. Off by default (a benchmark knob,
# --window-host-cover): on one H100, W2 with it at 1.25 gave 59,447 / 57,768 output tok/s against 59,515 / 59,846
# without (alternating; 59,856 and 61,682 in two more runs with it), with windows of 8 steps instead of 4 in most of
# the run and late requests waiting longer (w2-window-host-cover*_h100_2026-12-07_*.json).
HOST_COVER = 0.0
HOST_SAMPLES = 5  # the host's time at a window length: the median of its last HOST_SAMPLES iterations (outliers aside)
PROBE_EVERY = 16  # windows lengthened for the host: every PROBE_EVERY-th runs one length shorter, to re-measure it


def adaptive_window(step_seconds: float | None, max_window: int, target_s: float | None = None,
                    host_seconds: Mapping[int, float] | None = None) -> int:
    """Decode steps per window that the engine chooses: as many as fit in ``target_s`` at
    ``step_seconds`` a step (the moving average of decode steps measured so far), between 1 and
    ``max_window``, rounded down to a power of two below ``max_window``; 1 until a step was measured.
    ``target_s`` defaults to :data:`WINDOW_TARGET_S`. A request that arrives while a window runs is
    admitted at the next step boundary after it, so it waits at most about ``target_s`` (twice,
    when the next window was launched ahead); a request that reaches EOS or a stop string computes
    at most the rest of the window in tokens that are dropped.

    ``host_seconds`` maps window lengths to the host's time per decode-only iteration at that length
    (:class:`DecodeStepClock`). From the length above, the window doubles (up to ``max_window``) while
    its device time does not cover :data:`HOST_COVER` times the host's time measured at that length; a
    length not measured yet is taken as it is. A longer window then costs a new request no more wait
    than the host already does."""
    if not step_seconds or step_seconds <= 0:
        return 1
    fits = min(max_window, int((WINDOW_TARGET_S if target_s is None else target_s) / step_seconds))
    if fits >= max_window:
        return max_window  # the length the window graphs are captured for
    length = 1 << (fits.bit_length() - 1) if fits > 1 else 1  # a power of two: few distinct window lengths
    if host_seconds and HOST_COVER > 0:
        while length < max_window:
            host = host_seconds.get(length)
            if host is None or length * step_seconds >= HOST_COVER * host:
                break
            length = min(2 * length, max_window)
    return length


def window_lengths(num_scheduler_steps: int, adaptive: bool) -> list[int]:
    """The window lengths the engine can choose, ascending: every length :func:`adaptive_window` returns
    above 1 (the powers of two below ``num_scheduler_steps``, and ``num_scheduler_steps``) for engine-sized
    windows; the user's fixed ``num_scheduler_steps`` otherwise. The window graphs are captured for these
    lengths (windows cut near ``max_model_len`` run step by step)."""
    if num_scheduler_steps <= 1:
        return []
    if not adaptive:
        return [num_scheduler_steps]
    return sorted({1 << k for k in range(1, num_scheduler_steps.bit_length()) if 1 << k < num_scheduler_steps}
                  | {num_scheduler_steps})


def window_size(out: SchedulerOutput, num_scheduler_steps: int, max_model_len: int,
                admission_possible: bool, num_pending: int = 0) -> int:
    """How many decode steps the batch ``out`` can run back to back: ``num_scheduler_steps``,
    less near ``max_model_len``, or 1 (see the module docstring).

    Args:
        admission_possible: a waiting request could join the batch in the next step.
        num_pending: tokens per request that the step in flight samples and the host has not
            appended yet (a batch scheduled ahead, with async scheduling); 0 otherwise.
    """
    if num_scheduler_steps <= 1 or not out.scheduled or out.preempted_ids or admission_possible:
        return 1
    longest = 0  # the most tokens of a request: it is the first to reach max_model_len
    # One pass (every window checks every request, the hot path): out.is_decode_only, then sampling that no
    # earlier token changes (Request.sampling_step_invariant, no grammar, min_tokens reached with the pending ones).
    for item in out.scheduled:
        request = item.request
        if (item.num_scheduled_tokens != 1 or not item.samples or item.forks
                or not request.sampling_step_invariant or request.grammar is not None  # a grammar's mask needs each token
                or len(request.output_token_ids) + num_pending < request.sampling_params.min_tokens):
            return 1
        num_tokens = len(request.all_token_ids)
        if num_tokens > longest:
            longest = num_tokens
    # a request has len(all_token_ids) + num_pending tokens; it finishes by length at max_model_len
    return max(min(num_scheduler_steps, max_model_len - longest - num_pending), 1)


def reserve_window(out: SchedulerOutput, kv: KVCacheManager, num_steps: int) -> bool:
    """Grow the block tables of ``out``'s requests (each already holding the slot of its first
    step) to hold ``num_steps`` tokens each; all or nothing. Returns False, holding nothing more,
    when the pool cannot hold every request's window."""
    return kv.allocate_window_slots([item.request for item in out.scheduled], num_steps)


def rows_ahead(prev: SchedulerOutput, running: list[Request], max_model_len: int) -> list[int] | None:
    """Async scheduling with multi-step windows: the rows of ``prev`` (in flight) that the step
    after it decodes, or None when that step is not known without ``prev``'s tokens.

    The next batch is the running requests, which must be ``prev``'s in ``prev``'s order less
    those that finished since ``prev`` was launched (their rows are skipped: the next step's
    inputs are the other rows of ``prev``'s last tokens). A request that reaches ``max_tokens``,
    EOS or a stop string within ``prev`` is decoded once more and those tokens are thrown away;
    without that, with requests of many lengths nearly every window would end one and no window
    would run ahead. None when a running request did not decode in ``prev`` (one sampled token,
    no forks), could reach ``max_model_len`` within ``prev``, is short of ``min_tokens`` (the
    sampling metadata's ban would not count ``prev``'s tokens), or follows a grammar and ``prev``
    was a window (a constrained request runs ahead only after a single step).
    """
    scheduled, num_steps, rows, row = prev.scheduled, prev.num_steps, [], 0
    num_rows, window = len(scheduled), num_steps > 1
    longest = max_model_len - num_steps  # a request with this many tokens could reach max_model_len in prev
    for request in running:
        while row < num_rows:
            item = scheduled[row]
            if item.request is request:
                break
            row += 1
        else:
            return None
        if (item.num_scheduled_tokens != 1 or not item.samples or item.forks
                or (window and request.grammar is not None)  # its masks need every token of prev
                or len(request.all_token_ids) >= longest
                or len(request.output_token_ids) < request.sampling_params.min_tokens):
            return None
        rows.append(row)
        row += 1
    return rows or None


class DecodeStepClock:
    """Times decode-only launches: seconds per decode step, as a moving average, from each launch's device time
    where it was measured (CUDA), else between the returns of consecutive decode-only launches (a step with a
    prefill in between restarts that clock); see :data:`WINDOW_CLOCK`.

    Attributes:
        window_steps: decode-only launches by their number of steps.
        step_seconds: the moving average (:data:`STEP_TIME_SMOOTHING`), None until measured.
    """

    def __init__(self) -> None:
        self.window_steps: collections.Counter[int] = collections.Counter()
        self.step_seconds: float | None = None
        self._last_finish: float | None = None  # when the last decode-only launch's tokens came back
        self._last_steps = 0  # that launch's number of steps
        self._host: dict[int, collections.deque[float]] = {}  # the host's times per iteration, by window length
        self._lengthened = 0  # windows chosen longer than the latency target for the host

    @property
    def host_seconds(self) -> dict[int, float]:
        """Where the device times its launches (CUDA), the host's time per decode-only iteration by the length of
        the window whose tokens it processed: from those tokens coming back to the wait for the next launch's
        (the median of the last :data:`HOST_SAMPLES`). Empty until measured, and on the CPU."""
        return {length: sorted(times)[len(times) // 2] for length, times in self._host.items()}

    def restart(self) -> None:
        """Nothing was in flight (the engine was idle, or waited for work): the next launch's return starts the clock
        again, so that the idle time counts neither as a step's nor as the host's."""
        self._last_finish = None

    def choose_window(self, max_window: int) -> int:
        """The next window's length (:func:`adaptive_window` at the measured step and host times); every
        :data:`PROBE_EVERY`-th window lengthened for the host is one length shorter, which re-measures the host there."""
        target = adaptive_window(self.step_seconds, max_window)
        if HOST_COVER <= 0 or WINDOW_CLOCK != "device" or not self._host:  # the wall clock holds the host's time
            return target
        length = adaptive_window(self.step_seconds, max_window, host_seconds=self.host_seconds)
        if length > target:
            self._lengthened += 1
            if self._lengthened % PROBE_EVERY == 0:
                length = max(target, 1 << ((length - 1).bit_length() - 1))  # the power of two below
        return length

    def observe(self, out: SchedulerOutput, finished: float, device_seconds: float | None = None,
                waited: float | None = None) -> float | None:
        """Record launch ``out`` whose tokens came back at ``finished`` (``time.perf_counter()`` s) after
        ``device_seconds`` on the device (None where not measured), the host having started to wait for
        them at ``waited``; returns the new step-time average when this launch updated it, else None."""
        if not out.is_decode_only:
            self._last_finish = None
            return None
        self.window_steps[out.num_steps] += 1
        last, last_steps = self._last_finish, self._last_steps
        self._last_finish, self._last_steps = finished, out.num_steps
        if device_seconds is not None and last is not None and waited is not None:
            times = self._host.setdefault(last_steps, collections.deque(maxlen=HOST_SAMPLES))
            times.append(max(waited - last, 0.0))
        if device_seconds is not None and WINDOW_CLOCK == "device":
            seconds = device_seconds / out.num_steps
        elif last is None:
            return None
        else:
            seconds = (finished - last) / out.num_steps
        average = self.step_seconds
        self.step_seconds = seconds if average is None else average + STEP_TIME_SMOOTHING * (seconds - average)
        return self.step_seconds
