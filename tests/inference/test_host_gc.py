"""The engine raises the garbage collector's first-generation threshold (fewer pauses in its host loop), never
lowers one the program set, and leaves Python's when told to."""
from __future__ import annotations

import gc

import pytest

from inference import LLM, SamplingParams
from inference.engine.host_gc import DEFAULT_GEN0_THRESHOLD, GEN0_THRESHOLD_ENV, raise_gc_threshold


@pytest.fixture
def python_thresholds(monkeypatch):
    """Python's default thresholds for the test, the process's own restored after it."""
    saved = gc.get_threshold()
    monkeypatch.delenv(GEN0_THRESHOLD_ENV, raising=False)
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_an_engine_raises_the_threshold_and_keeps_the_others(python_thresholds):
    llm = LLM(max_model_len=128, num_kv_blocks=16)
    assert gc.get_threshold() == (DEFAULT_GEN0_THRESHOLD, 10, 10)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_the_variable_sets_it_or_leaves_pythons(python_thresholds, monkeypatch):
    monkeypatch.setenv(GEN0_THRESHOLD_ENV, "0")
    assert raise_gc_threshold() is None and gc.get_threshold() == (700, 10, 10)
    monkeypatch.setenv(GEN0_THRESHOLD_ENV, "50000")
    assert raise_gc_threshold() == (700, 10, 10) and gc.get_threshold() == (50000, 10, 10)


def test_a_higher_threshold_is_kept(python_thresholds):
    gc.set_threshold(100_000, 20, 20)
    assert raise_gc_threshold() is None and gc.get_threshold() == (100_000, 20, 20)


def test_a_bad_value_names_the_variable(python_thresholds, monkeypatch):
    monkeypatch.setenv(GEN0_THRESHOLD_ENV, "lots")
    with pytest.raises(ValueError, match=GEN0_THRESHOLD_ENV):
        raise_gc_threshold()
