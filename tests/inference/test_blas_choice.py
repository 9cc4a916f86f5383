"""The per-layer choice of cuBLAS or cuBLASLt for the dense GEMMs of the CUDA graphs (inference/models/blas_choice.py).

On the CPU: the decision follows the timings (a fake timer stands in for the CUDA-graph replays), every layer of a
shape gets the same row counts, and ``linear`` takes cuBLASLt only for those row counts and only while a graph is
captured. On a GPU: the real timing on a bfloat16 model, and a captured cuBLASLt GEMM gives cuBLAS's product.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.model_loader import load_hf_config
from inference.models import blas_choice, build_model
from inference.models import parallel_layers
from .conftest import make_tiny_model

HAS_CUDA = torch.cuda.is_available()
LT, DEFAULT = torch._C._BlasBackend.Cublaslt, torch._C._BlasBackend.Cublas


@pytest.fixture
def blas_preference(monkeypatch):
    """Torch's preferred-BLAS setting, held here: a CPU build of torch refuses to prefer cuBLASLt (the GPU test
    below runs the real one). Returns the holder, a one-element list."""
    if HAS_CUDA:
        return None
    held = [DEFAULT]
    monkeypatch.setattr(torch._C, "_get_blas_preferred_backend", lambda: held[0])
    monkeypatch.setattr(torch._C, "_set_blas_preferred_backend", lambda backend: held.__setitem__(0, backend))
    return held


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Qwen2 (hidden 64, intermediate 128, two layers, untied head)."""
    return load_hf_config(make_tiny_model("qwen2", tmp_path_factory.mktemp("blas") / "qwen2", smollm2_tokenizer))


def _model(hf_config, dtype, device="cpu"):
    return build_model(hf_config=hf_config, dtype=dtype, device=device, max_position=256)


class FakeTimer:
    """Stands in for the CUDA-graph timing: records which GEMMs a run makes and through which library, and
    returns for it the time that ``seconds(name, rows, lt)`` gives."""

    def __init__(self, shapes: dict[tuple[int, int], str], seconds) -> None:
        self.shapes, self.seconds, self.runs = shapes, seconds, []

    def __call__(self, run):
        calls = []
        real = F.linear

        def spy(x, weight, bias=None):
            calls.append((self.shapes[tuple(weight.shape)], x.shape[0], torch._C._get_blas_preferred_backend() == LT))
            return real(x, weight, bias)

        F.linear = spy
        try:
            run()
        finally:
            F.linear = real
        self.runs.append(calls)
        (name, rows, lt), = set(calls)  # one kind, one row count, one library per timed run
        return lambda: self.seconds(name, rows, lt) * len(calls)


def _shapes(model) -> dict[tuple[int, int], str]:
    layer = model.model.layers[0]
    return {tuple(layer.self_attn.qkv_proj.weight.shape): "qkv_proj", tuple(layer.self_attn.o_proj.weight.shape): "o_proj",
            tuple(layer.mlp.gate_up_proj.weight.shape): "gate_up_proj", tuple(layer.mlp.down_proj.weight.shape): "down_proj",
            tuple(model.lm_head_weight.shape): "lm_head"}


def test_layers_take_cublaslt_at_the_row_counts_where_it_timed_faster(tiny_qwen2, blas_preference):
    model = _model(tiny_qwen2, torch.bfloat16)

    def seconds(name, rows, lt):  # cuBLASLt 10% faster on gate_up from 16 rows and on the LM head; a tie on down
        if lt and ((name == "gate_up_proj" and rows >= 16) or name == "lm_head"):
            return 0.9
        return 1.0 if not lt or name == "down_proj" else 1.2

    timer = FakeTimer(_shapes(model), seconds)
    choice = blas_choice.choose(model, [1, 8, 16, 64, 8], timer=timer)

    assert choice.lt_rows == {"qkv_proj": [], "o_proj": [], "gate_up_proj": [16, 64], "down_proj": [],
                              "lm_head": [1, 8, 16, 64]}
    for layer in model.model.layers:  # every layer of a shape, timed together as a step reads them
        assert layer.mlp.gate_up_proj.lt_rows == {16, 64}
        assert layer.mlp.down_proj.lt_rows == frozenset()  # within the margin: stays on cuBLAS
    assert model.lm_head_lt_rows == {1, 8, 16, 64}
    assert all(len(calls) == len(model.model.layers) for calls in timer.runs if calls[0][0] != "lm_head")
    assert "gate_up_proj at 16, 64 rows" in choice.describe()
    assert 0 < choice.saving < 0.2


def test_float32_layers_and_the_knob_keep_cublas(tiny_qwen2, monkeypatch):
    timer = FakeTimer({}, lambda *a: 1.0)
    model = _model(tiny_qwen2, torch.float32)
    assert blas_choice.choose(model, [1, 8], timer=timer).lt_rows == {}
    assert timer.runs == []
    monkeypatch.setattr(blas_choice, "ENABLED", False)
    model = _model(tiny_qwen2, torch.bfloat16)
    assert blas_choice.choose(model, [1, 8], timer=timer).lt_rows == {}
    assert model.model.layers[0].mlp.gate_up_proj.lt_rows == frozenset()


def test_where_cublaslt_cannot_run_every_layer_keeps_cublas(tiny_qwen2, blas_preference):
    model = _model(tiny_qwen2, torch.bfloat16)
    shapes = _shapes(model)

    def timer(run):  # cuBLASLt twice as fast, but the LM head (timed last) fails, as a capture might
        spy = FakeTimer(shapes, lambda name, rows, lt: 0.5 if lt else 1.0)
        replay = spy(run)
        if spy.runs[0][0][0] == "lm_head":
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul\nmore")
        return replay

    choice = blas_choice.choose(model, [1, 8], timer=timer)
    assert choice.error == "CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul"
    assert "cuBLAS for every dense GEMM" in choice.describe() and choice.lt_rows == {}
    assert model.model.layers[0].mlp.gate_up_proj.lt_rows == frozenset()  # earlier kinds timed faster: not kept
    assert model.lm_head_lt_rows == frozenset()


@pytest.mark.parametrize("capturing", [False, True])
def test_linear_takes_cublaslt_only_for_chosen_row_counts_of_a_captured_graph(monkeypatch, blas_preference, capturing):
    backends = []
    real = F.linear

    def spy(x, weight, bias=None):
        backends.append(torch._C._get_blas_preferred_backend())
        return real(x, weight, bias)

    monkeypatch.setattr(F, "linear", spy)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    weight = torch.randn(8, 4, dtype=torch.bfloat16)
    for rows in (1, 16, 32):
        out = parallel_layers.linear(torch.randn(rows, 4, dtype=torch.bfloat16), weight, None, frozenset({16}))
        assert out.shape == (rows, 8)
    assert backends == ([DEFAULT, LT, DEFAULT] if capturing else [DEFAULT] * 3)
    assert torch._C._get_blas_preferred_backend() == DEFAULT  # restored


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs and cuBLASLt")
def test_on_a_gpu_the_choice_is_timed_and_a_captured_cublaslt_gemm_gives_cublas_s_product(tiny_qwen2):
    model = _model(tiny_qwen2, torch.bfloat16, "cuda")
    choice = blas_choice.choose(model, [1, 16, 64])
    assert set(choice.lt_rows) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert choice.cublas_seconds > 0 and choice.chosen_seconds <= choice.cublas_seconds
    weight, x = model.model.layers[0].mlp.gate_up_proj.weight, torch.randn(16, 64, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    parallel_layers.linear(x, weight, None, frozenset({16}))  # warm-up
    with torch.cuda.graph(graph):
        out = parallel_layers.linear(x, weight, None, frozenset({16}))
    graph.replay()
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-2, atol=1e-2)
