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
    """At 2 ms a step, 12 ms give 4-step windows. A host taking 7 ms per window would leave the device idle
    between 8 ms windows: the window grows to 8 steps (the bound), never past it; a host that keeps up changes
    nothing."""
    assert adaptive_window(0.002, 8, target_s=0.012) == 4
    assert adaptive_window(0.002, 8, target_s=0.012, host_seconds=0.007) == 8  # 1.25 x 7 ms needs 5 steps
    assert adaptive_window(0.002, 8, target_s=0.012, host_seconds=0.005) == 4  # 4 steps cover 6.25 ms
    assert adaptive_window(0.002, 8, target_s=0.012, host_seconds=0.100) == 8
    assert adaptive_window(0.002, 6, target_s=0.012, host_seconds=0.007) == 6
    assert adaptive_window(0.020, 8, target_s=0.012, host_seconds=0.030) == 2  # a slow device: 2 x 20 ms cover 37.5
    monkeypatch.setattr(decode_windows, "HOST_COVER", 0)
    assert adaptive_window(0.002, 8, target_s=0.012, host_seconds=0.007) == 4


def test_the_host_time_is_measured_between_decode_launches_where_the_device_times_them():
    """The host's time per iteration is from one launch's tokens coming back to the wait for the next's."""
    window = SimpleNamespace(is_decode_only=True, num_steps=4)
    clock = DecodeStepClock()
    clock.observe(window, finished=1.000, device_seconds=0.008, waited=0.999)
    assert clock.host_seconds is None  # no launch before it
    clock.observe(window, finished=1.012, device_seconds=0.008, waited=1.010)
    assert clock.host_seconds == pytest.approx(0.010)
    clock.observe(window, finished=1.020, device_seconds=0.008, waited=1.015)
    assert clock.host_seconds == pytest.approx(0.010 + decode_windows.STEP_TIME_SMOOTHING * (0.003 - 0.010))
    clock.observe(SimpleNamespace(is_decode_only=False, num_steps=1), finished=1.1)  # a prefill restarts it
    before = clock.host_seconds
    clock.observe(window, finished=1.2, device_seconds=0.008, waited=1.19)
    assert clock.host_seconds == before
    cpu = DecodeStepClock()  # no device time: the host's time holds the computation itself; not measured
    cpu.observe(window, finished=1.000, waited=1.0)
    cpu.observe(window, finished=1.010, waited=1.010)
    assert cpu.host_seconds is None


def test_window_graphs_are_captured_for_every_length_the_engine_chooses():
    step_times = [1e-5 * 1.1 ** k for k in range(120)]  # 10 us to 1 s a step
    for bound in (2, 4, 6, 8):
        chosen = {adaptive_window(t, bound, host_seconds=h) for t in step_times for h in (None, 1e-3, 0.1)} - {1}
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
