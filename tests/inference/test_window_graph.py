"""Whole multi-step windows replayed as one CUDA graph (``runner/window_graph.py``).

CUDA graphs need a GPU; on the CPU the window's captured body (its in-graph input advance, LM head
and argmax over padded buckets) runs eagerly in place of the replay, under Triton's interpreter, and
must give the step-by-step path's greedy tokens. On the H200 the same tests capture real graphs.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from .triton_interpreter import HAS_CUDA  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)

pytest.importorskip("triton")

from inference import LLM, SamplingParams  # noqa: E402
from inference.engine import arg_utils  # noqa: E402
from inference.runner.cuda_graph import CudaGraphRunner  # noqa: E402
from inference.runner.window_graph import DecodeWindowGraphs  # noqa: E402
from inference.sched import decode_windows  # noqa: E402

from .conftest import free_device_memory, make_tiny_model  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"


class _EagerWindow:
    """Stands in for a captured window graph on the CPU: ``replay()`` runs the captured body."""

    def __init__(self, windows: DecodeWindowGraphs, num_steps: int, size: int, replays: list) -> None:
        self.windows, self.num_steps, self.size, self.replays = windows, num_steps, size, replays

    def replay(self) -> None:
        self.replays.append((self.num_steps, self.size))
        self.windows._window(self.num_steps, self.size)


def _llm(folder, **kw) -> LLM:
    """An engine with windows of 4 steps (``num_scheduler_steps=None`` in ``kw``: engine-sized windows)."""
    memory = dict(gpu_memory_utilization=0.3) if HAS_CUDA else dict(kv_cache_space=0.05)
    kw.setdefault("num_scheduler_steps", 4)
    return LLM(model=str(folder), max_model_len=128, max_num_batched_tokens=64, attention_backend="triton",
               device=DEVICE, dtype="float32", block_size=16, max_num_seqs=8, **memory, **kw)


def _attach_windows(llm: LLM, lengths: tuple[int, ...] = (4,)) -> list:
    """The engine's runner with window graphs of ``lengths`` steps: captured on a GPU (lengths as the engine
    chose them), eager stand-ins on the CPU. Returns the list of ``(window length, batch)`` replayed."""
    runner = llm.llm_engine.runner
    replays: list[tuple[int, int]] = []
    if HAS_CUDA:
        assert runner.window_graphs is not None and runner.window_graphs.windows
        assert runner.window_graphs.lengths == list(lengths)
        assert runner.graph_memory_bytes > 0  # measured at capture, and logged
        original = runner.window_graphs.run

        def counted(inputs, num_steps):
            replays.append((num_steps, inputs.input_ids.shape[0]))
            return original(inputs, num_steps)
        runner.window_graphs.run = counted
        return replays
    graphs = CudaGraphRunner(runner.model, runner.kv_caches, 8, -(-128 // 16), 16, runner.num_kv_heads, DEVICE)
    windows = DecodeWindowGraphs(graphs, runner.model.compute_logits, list(lengths))
    windows.windows = {(n, size): _EagerWindow(windows, n, size, replays) for n in lengths for size in graphs.sizes}
    runner.window_graphs = windows
    return replays


def _generate(folder, prompts, params, windows: bool, lengths: tuple[int, ...] = (4,), **kw) -> tuple[list, list]:
    """Token ids per prompt and the windows that ran as graphs (``(length, batch)``): the step-by-step engine
    (eager) or one with window graphs of ``lengths``. The engine is dropped on return; KV blocks all free again."""
    llm = _llm(folder, **kw) if windows else _llm(folder, enforce_eager=True, **kw)
    replays = _attach_windows(llm, lengths) if windows else []
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    llm.close()
    return [o.outputs[0].token_ids for o in outs], replays


def _both_paths(folder, prompts, params, **kw) -> tuple[list, list, list]:
    expected, _ = _generate(folder, prompts, params, windows=False, **kw)
    free_device_memory()
    got, replays = _generate(folder, prompts, params, windows=True, **kw)
    free_device_memory()
    return expected, got, replays


@pytest.mark.timeout(900)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_window_graphs_give_the_step_by_step_greedy_tokens(tmp_path, smollm2_tokenizer, async_scheduling):
    """Also with async scheduling: the next window launched before this one's tokens are back, its inputs
    this window's last tokens (a view of the graph's token buffer), fewer rows once requests finish."""
    folder = make_tiny_model("llama", tmp_path / "llama", smollm2_tokenizer)
    rng = random.Random(5)
    # 5 and then fewer running requests: buckets with padding rows; lengths that end mid-window.
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 30))] for _ in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 9, 14, 17, 23)]
    expected, got, replays = _both_paths(folder, prompts, params, async_scheduling=async_scheduling)
    assert got == expected
    assert replays, "no window ran as a graph"


@pytest.mark.timeout(900)
def test_engine_sized_windows_replay_the_graph_of_their_own_length(tmp_path, smollm2_tokenizer, monkeypatch):
    """Without ``num_scheduler_steps`` the engine sizes windows of 2, 4 or 8 steps and each length has its graphs:
    windows of every length, one after another and launched ahead, replay as graphs with the step-by-step
    path's greedy tokens."""
    monkeypatch.setattr(arg_utils, "AUTO_WINDOW_DEVICES", ("cuda", "cpu"))
    chosen = itertools.cycle([2, 8, 4])  # in place of the measured step time's choice
    monkeypatch.setattr(decode_windows.DecodeStepClock, "choose_window", lambda self, max_window: next(chosen))
    folder = make_tiny_model("llama", tmp_path / "llama", smollm2_tokenizer)
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 30))] for _ in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (31, 40, 45, 52)]
    expected, _ = _generate(folder, prompts, params, windows=False)
    free_device_memory()
    got, replays = _generate(folder, prompts, params, windows=True, lengths=(2, 4, 8), num_scheduler_steps=None,
                             async_scheduling=True)
    free_device_memory()
    assert got == expected
    assert {n for n, _ in replays} == {2, 4, 8}, replays


@pytest.mark.timeout(900)
def test_sampled_requests_keep_the_step_by_step_window(tmp_path, smollm2_tokenizer):
    """A window with a non-greedy request is not a graph window; its seeded tokens are the eager path's."""
    folder = make_tiny_model("llama", tmp_path / "llama", smollm2_tokenizer)
    prompts = [[101, 2002, 3003, 4004, 5005], [7, 8, 9, 10, 11, 12]]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)]
    expected, got, replays = _both_paths(folder, prompts, params)
    assert got == expected
    assert not replays


@pytest.mark.timeout(900)
def test_capture_warm_up_writes_no_cache_slot_even_past_max_model_len(tmp_path, smollm2_tokenizer):
    """Capture runs a window of padding rows only: their positions stay 0, so even a window longer than
    ``max_model_len`` (24 steps, 16 positions) reads a block-table column and a rotary row that exist, and
    nothing lands in the KV cache."""
    folder = make_tiny_model("llama", tmp_path / "llama", smollm2_tokenizer)
    memory = dict(gpu_memory_utilization=0.3) if HAS_CUDA else dict(kv_cache_space=0.05)
    llm = LLM(model=str(folder), max_model_len=16, max_num_batched_tokens=16, attention_backend="triton",
              device=DEVICE, dtype="float32", block_size=16, max_num_seqs=4, enforce_eager=True, **memory)
    runner = llm.llm_engine.runner
    for cache in runner.kv_caches:
        cache.zero_()
    graphs = CudaGraphRunner(runner.model, runner.kv_caches, 4, 1, 16, runner.num_kv_heads, DEVICE)
    windows = DecodeWindowGraphs(graphs, runner.model.compute_logits, [24])
    with torch.inference_mode():
        graphs.slot_mapping.fill_(-1)
        windows._window(24, 4)  # what capture() runs before capturing, on buffers it leaves in this state
    assert all(int(cache.count_nonzero()) == 0 for cache in runner.kv_caches)
    assert int(graphs.positions.abs().sum()) == 0 and int(graphs.seq_lens.abs().sum()) == 0
    llm.close()
    del llm, runner, graphs, windows
    free_device_memory()
