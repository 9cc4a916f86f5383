"""Piecewise CUDA graphs for steps that compute prompt tokens (``runner/piecewise_graph.py``).

CUDA graphs need a GPU; on the CPU each captured piece runs eagerly in place of its replay, under Triton's
interpreter, with attention between the pieces on the step's real rows, and must give the eager engine's
greedy tokens: padded buckets, chunked prompts beside running decodes, prefix-cache hits. On a GPU the same
tests capture real graphs.
"""
from __future__ import annotations

import random

import pytest
import torch

from .triton_interpreter import HAS_CUDA  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)

pytest.importorskip("triton")

from inference import LLM, SamplingParams  # noqa: E402
from inference.runner.piecewise_graph import PiecewiseGraphRunner, piecewise_token_sizes  # noqa: E402

from .conftest import free_device_memory, make_tiny_model  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"


class _EagerPiece:
    """Stands in for a captured piece on the CPU: ``replay()`` runs the captured function."""

    def capture(self, fn, pool) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def _llm(folder, **kw) -> LLM:
    memory = dict(gpu_memory_utilization=0.3) if HAS_CUDA else dict(kv_cache_space=0.05)
    return LLM(model=str(folder), max_model_len=256, max_num_batched_tokens=48, attention_backend="triton",
               device=DEVICE, dtype="float32", block_size=16, max_num_seqs=6, enable_prefix_caching=True,
               **memory, **kw)


def _generate(folder, prompts, params, piecewise: bool) -> tuple[list, list]:
    """Per prompt its token ids and prompt logprobs (where asked for); the (token count, leading decodes) of
    the steps the pieces ran; the eager engine otherwise."""
    llm = _llm(folder) if piecewise and HAS_CUDA else _llm(folder, enforce_eager=True)
    runner = llm.llm_engine.runner
    steps: list[int] = []
    if piecewise:
        if not HAS_CUDA:
            runner.piecewise_graphs = PiecewiseGraphRunner(runner.model, runner.kv_caches, piecewise_token_sizes(48),
                                                           16, "triton", graph_factory=_EagerPiece)
            runner.piecewise_graphs.capture()
        pieces = runner.piecewise_graphs
        assert pieces is not None and pieces.graphs
        original = pieces.run

        def counted(inputs):
            steps.append((inputs.input_ids.shape[0], inputs.meta.num_leading_decodes))
            return original(inputs)
        pieces.run = counted
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    llm.close()
    return [(o.outputs[0].token_ids, _rounded(o.prompt_logprobs)) for o in outs], steps


def _rounded(prompt_logprobs) -> list | None:
    if prompt_logprobs is None:
        return None
    return [None if p is None else {t: round(lp.logprob, 3) for t, lp in p.items()} for p in prompt_logprobs]


@pytest.mark.timeout(900)
def test_piecewise_graphs_give_the_eager_greedy_tokens(tmp_path, smollm2_tokenizer):
    """Prompts of 5-70 tokens into 48-token steps: chunked prompts beside running decodes (mixed steps),
    step sizes between buckets (padding rows), a repeated prompt served from the prefix cache, and prompt
    logprobs (read from the pieces' hidden states of every prompt row)."""
    folder = make_tiny_model("llama", tmp_path / "llama", smollm2_tokenizer)
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 70, 13, 33, 21)]
    prompts.append(list(prompts[1]))  # a prefix-cache hit: its full blocks are not recomputed
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, prompt_logprobs=2 if n == 9 else None)
              for n in (12, 7, 15, 9, 11, 6)]
    expected, _ = _generate(folder, prompts, params, piecewise=False)
    free_device_memory()  # the engine is dropped once _generate returns
    got, steps = _generate(folder, prompts, params, piecewise=True)
    free_device_memory()
    assert got == expected
    assert steps, "no step ran through the pieces"
    sizes = piecewise_token_sizes(48)
    assert any(n not in sizes for n, _ in steps), f"no padded bucket among steps {steps}"
    assert any(decodes > 0 for _, decodes in steps), f"no step prefilled beside running decodes: {steps}"
    assert got[3][1] is not None and len(got[3][1]) == len(prompts[3])


def test_token_buckets_stop_at_the_step_budget():
    assert piecewise_token_sizes(48) == [8, 16, 24, 32, 48]
    sizes = piecewise_token_sizes(16384)
    assert sizes[:5] == [8, 16, 24, 32, 64] and sizes[-3:] == [384, 448, 512]
    assert piecewise_token_sizes(8) == [8]


@pytest.mark.timeout(600)
def test_capture_writes_no_cache_slot(tmp_path, smollm2_tokenizer):
    """The warm-up and capture run padding rows only (slot -1): the KV cache stays as it was."""
    folder = make_tiny_model("llama", tmp_path / "llama", smollm2_tokenizer)
    llm = _llm(folder, enforce_eager=True)
    runner = llm.llm_engine.runner
    for cache in runner.kv_caches:
        cache.zero_()
    factory = None if HAS_CUDA else _EagerPiece
    pieces = PiecewiseGraphRunner(runner.model, runner.kv_caches, [8, 16], 16, "triton", graph_factory=factory)
    pieces.capture()
    assert all(int(cache.count_nonzero()) == 0 for cache in runner.kv_caches)
    assert sorted(pieces.graphs) == [8, 16] and all(len(g) == 3 for g in pieces.graphs.values())
    pieces.release()
    assert not pieces.graphs
    llm.close()
    del llm, runner, pieces
    free_device_memory()
