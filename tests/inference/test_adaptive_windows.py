"""Decode windows sized by the engine (``num_scheduler_steps`` not given): as many decode steps per
window as fit in a target time at the measured step time, up to ``AUTO_MAX_WINDOW``; the outputs
are those of single steps."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from inference import LLM, SamplingParams
from inference.engine import arg_utils
from inference.sched import decode_windows
from inference.sched.decode_windows import AUTO_MAX_WINDOW, DecodeStepClock, adaptive_window, window_lengths


def test_the_window_fits_the_target_time_at_the_measured_step_time():
    assert adaptive_window(None, 8) == 1  # nothing measured yet
    assert adaptive_window(0.002, 8, target_s=0.015) == 4  # 7 fit: a power of two below the bound
    assert adaptive_window(0.0018, 8, target_s=0.015) == 8  # 8 fit: the bound (its window graphs)
    assert adaptive_window(0.006, 8, target_s=0.015) == 2
    assert adaptive_window(0.030, 8, target_s=0.015) == 1  # a step longer than the target
    assert adaptive_window(0.0001, 8, target_s=0.015) == 8  # never past the upper bound


def test_a_window_lasts_long_enough_on_the_device_to_cover_the_host(monkeypatch):
    """At 2 ms a step, 12 ms give 4-step windows. A host taking 7 ms per iteration at that length would leave the
    device idle between 8 ms windows: the window doubles to 8 steps (the bound), never past it; a host that keeps up
    at 4 steps keeps 4, whatever it takes at 8."""
    monkeypatch.setattr(decode_windows, "HOST_COVER", 1.25)  # the benchmark knob's value; off by default
    assert adaptive_window(0.002, 8, target_s=0.012) == 4
    assert adaptive_window(0.002, 8, target_s=0.012, host_seconds={4: 0.007}) == 8  # 1.25 x 7 ms > 8 ms
    assert adaptive_window(0.002, 8, target_s=0.012, host_seconds={4: 0.005, 8: 0.009}) == 4  # 4 steps cover 6.25 ms
    assert adaptive_window(0.002, 8, target_s=0.012, host_seconds={4: 0.100, 8: 0.100}) == 8
    assert adaptive_window(0.002, 6, target_s=0.012, host_seconds={4: 0.007}) == 6
    assert adaptive_window(0.020, 8, target_s=0.012, host_seconds={1: 0.030, 2: 0.031}) == 2  # 2 x 20 ms cover 38.75
    assert adaptive_window(0.020, 8, target_s=0.012, host_seconds={1: 0.030, 2: 0.040}) == 4
    monkeypatch.setattr(decode_windows, "HOST_COVER", 0.0)
    assert adaptive_window(0.002, 8, target_s=0.012, host_seconds={4: 0.007}) == 4


def test_the_host_time_is_measured_between_decode_launches_where_the_device_times_them(monkeypatch):
    """The host's time per iteration is from one launch's tokens coming back to the wait for the next's, by the
    length of the window it processed; an outlier does not move the median, an idle engine counts nothing."""
    monkeypatch.setattr(decode_windows, "WINDOW_TARGET_S", 0.008)  # 4 steps of 2 ms
    monkeypatch.setattr(decode_windows, "HOST_COVER", 1.25)
    four, eight = (SimpleNamespace(is_decode_only=True, num_steps=n) for n in (4, 8))
    clock = DecodeStepClock()
    clock.observe(four, finished=1.000, device_seconds=0.008, waited=0.999)
    assert clock.host_seconds == {}  # no launch before it
    now = 1.000
    for host in (0.007, 0.007, 0.5, 0.007):  # a host slower than 4 steps of device time, and one outlier
        clock.observe(four, finished=now + host + 0.001, device_seconds=0.008, waited=now + host)
        now += host + 0.001
    assert clock.host_seconds == {4: pytest.approx(0.007)}
    assert clock.choose_window(8) == 8
    clock.observe(eight, finished=now + 0.010, device_seconds=0.016, waited=now + 0.009)  # processed 4 steps
    clock.observe(eight, finished=now + 0.017, device_seconds=0.016, waited=now + 0.016)  # processed 8 steps in 6 ms
    assert clock.host_seconds == {4: pytest.approx(0.007), 8: pytest.approx(0.006)}
    clock.restart()  # idle: the next launch starts the clock again
    clock.observe(eight, finished=now + 30, device_seconds=0.016, waited=now + 29.9)
    assert clock.host_seconds[8] == pytest.approx(0.006)
    clock.observe(SimpleNamespace(is_decode_only=False, num_steps=1), finished=now + 31)  # a prefill restarts it
    clock.observe(eight, finished=now + 32, device_seconds=0.016, waited=now + 31.9)
    assert clock.host_seconds[8] == pytest.approx(0.006)
    cpu = DecodeStepClock()  # no device time: the host's time holds the computation itself; not measured
    cpu.observe(four, finished=1.000, waited=1.0)
    cpu.observe(four, finished=1.010, waited=1.010)
    assert cpu.host_seconds == {}


def test_windows_lengthened_for_the_host_come_back_when_it_keeps_up(monkeypatch):
    """A slow spell makes 8-step windows; every PROBE_EVERY-th is 4 steps, which re-measures the host there: once it
    keeps up at 4 steps again, windows are back at the latency target."""
    monkeypatch.setattr(decode_windows, "HOST_COVER", 1.25)  # the benchmark knob's value; off by default
    monkeypatch.setattr(decode_windows, "WINDOW_TARGET_S", 0.008)
    clock, now, chosen = DecodeStepClock(), 0.0, []
    length = 4
    for host in [0.009] * 6 + [0.004] * 200:
        window = SimpleNamespace(is_decode_only=True, num_steps=length)
        clock.observe(window, finished=now + host + 0.001, device_seconds=0.002 * length, waited=now + host)
        now += host + 0.001
        length = clock.choose_window(8)
        chosen.append(length)
    assert 8 in chosen[:10]
    assert chosen[-20:] == [4] * 20, chosen
    monkeypatch.setattr(decode_windows, "WINDOW_CLOCK", "wall")  # the wall clock holds the host's time already
    assert clock.choose_window(8) == 4


def test_the_engine_lengthens_windows_for_a_host_slower_than_the_device(monkeypatch, test_prompts):
    """Wiring: with launches timed at 0.1 ms on the device and a target shorter than a step, windows are single
    steps, unless HOST_COVER is on and the host (here the CPU computing the steps) takes longer than they do on the
    device."""
    from inference.runner import step_handle
    monkeypatch.setattr(arg_utils, "AUTO_WINDOW_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(decode_windows, "WINDOW_TARGET_S", 1e-6)
    monkeypatch.setattr(step_handle.DeviceTimed, "device_seconds", property(lambda self: 1e-4))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for cover, expected in ((1.25, AUTO_MAX_WINDOW), (0.0, 1)):
        monkeypatch.setattr(decode_windows, "HOST_COVER", cover)
        with LLM(max_model_len=256, kv_cache_space=0.1) as llm:
            llm.generate(test_prompts[:2], params, use_tqdm=False)
            engine = llm.llm_engine
            assert max(steps for steps, n in engine.window_steps.items() if n) == expected, engine.window_steps
            assert engine.decode_clock.host_seconds  # measured


def test_window_graphs_are_captured_for_every_length_the_engine_chooses():
    step_times = [1e-5 * 1.1 ** k for k in range(120)]  # 10 us to 1 s a step
    for bound in (2, 4, 6, 8):
        hosts = (None, {n: 1e-3 for n in (1, 2, 4)}, {n: 0.1 for n in (1, 2, 4)})
        chosen = {adaptive_window(t, bound, host_seconds=h) for t in step_times for h in hosts} - {1}
        assert window_lengths(bound, adaptive=True) == sorted(chosen)
    assert window_lengths(8, adaptive=False) == [8]  # the user's fixed windows
    assert window_lengths(1, adaptive=True) == []


def test_the_step_time_is_the_device_time_where_measured(monkeypatch):
    """With the device's time of each launch, a host slower than the device (returns 10 ms apart for 4 steps of
    1 ms) does not make the windows shorter; the wall time between returns is the clock without it."""
    window = SimpleNamespace(is_decode_only=True, num_steps=4)
    clock = DecodeStepClock()
    assert clock.observe(window, finished=1.000, device_seconds=0.004) == pytest.approx(0.001)  # the first launch
    assert clock.observe(window, finished=1.010, device_seconds=0.004) == pytest.approx(0.001)
    monkeypatch.setattr(decode_windows, "WINDOW_CLOCK", "wall")
    wall = DecodeStepClock()
    assert wall.observe(window, finished=1.000, device_seconds=0.004) is None
    assert wall.observe(window, finished=1.010, device_seconds=0.004) == pytest.approx(0.0025)
    cpu = DecodeStepClock()  # no device time: the wall clock whatever the setting
    monkeypatch.setattr(decode_windows, "WINDOW_CLOCK", "device")
    cpu.observe(window, finished=1.000)
    assert cpu.observe(window, finished=1.010) == pytest.approx(0.0025)
    assert cpu.observe(SimpleNamespace(is_decode_only=False, num_steps=1), finished=1.02) is None


def test_defaults_size_windows_on_a_gpu_only():
    assert arg_utils.EngineArgs()._decode_windows("cuda:0") == dict(num_scheduler_steps=AUTO_MAX_WINDOW,
                                                                    adaptive_windows=True)
    assert arg_utils.EngineArgs()._decode_windows("cpu") == dict(num_scheduler_steps=1, adaptive_windows=False)
    assert arg_utils.EngineArgs(num_scheduler_steps=4)._decode_windows("cuda:0") == dict(
        num_scheduler_steps=4, adaptive_windows=False)  # the user's windows: fixed
    assert arg_utils.EngineArgs(tensor_parallel_size=2)._decode_windows("cuda:0")["num_scheduler_steps"] == 1


def _generate(llm: LLM, prompts, params):
    return [[o.token_ids for o in r.outputs] for r in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("target_s, windows", [(10.0, "long"), (1e-6, "single")])
def test_engine_sized_windows_give_the_tokens_of_single_steps(monkeypatch, test_prompts, target_s, windows):
    """A long target lets the engine run windows of AUTO_MAX_WINDOW steps; a target shorter than any
    step keeps it at single steps. Greedy tokens, EOS and max_tokens ends are those of single steps."""
    monkeypatch.setattr(arg_utils, "AUTO_WINDOW_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(decode_windows, "WINDOW_TARGET_S", target_s)
    params = [SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=i % 2 == 0) for i in range(4)]
    with LLM(max_model_len=256, kv_cache_space=0.1, num_scheduler_steps=1) as single:
        expected = _generate(single, test_prompts[:4], params)
    with LLM(max_model_len=256, kv_cache_space=0.1) as auto:
        engine = auto.llm_engine
        assert engine.config.scheduler.adaptive_windows
        assert _generate(auto, test_prompts[:4], params) == expected
        assert engine.decode_step_seconds is not None  # measured
        chosen = {steps for steps, count in engine.window_steps.items() if count}
        if windows == "long":
            assert max(chosen) == AUTO_MAX_WINDOW, engine.window_steps
        else:
            assert chosen == {1}, engine.window_steps
