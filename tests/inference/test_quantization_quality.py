"""Quality of AWQ and GPTQ on real SmolLM2 activations, one decoder layer at a time: cheap enough for
every run (seconds), unlike a whole-model perplexity (benchmarks/perplexity.py).

The packaged SmolLM2 is itself a Q4_1 GGUF (4-bit, blocks of 32 input channels, a float minimum per
block), so its "unquantized" linears already sit on a 4-bit grid; AWQ/GPTQ store integer zero points
and cannot reproduce a fractional minimum. The first test pins that fact, which bounds the quality any
4-bit AWQ/GPTQ checkpoint of this model can reach; the others guard the algorithms against regressions.
"""
from __future__ import annotations

import copy

import pytest
import torch

from inference.quantization import awq, packing
from inference.quantization.config import QuantizationConfig
from inference.quantization.layer_error import LayerErrors
from inference.quantization.perplexity import perplexity_tokens
from inference.model_loader import resolve_model
from inference.quantization.quantize import (LINEARS, CalibrationConfig, _first_layer_inputs, _gptq_layer,
                                             _run_layer, calibration_batch, quantize_model,
                                             quantized_source_types)

LAYER = 3
# Measured (layer 3, relative error of the residual update): round-to-nearest g64 0.065, GPTQ g64
# act-order 0.043, AWQ g64 (grid 10) 0.029.


@pytest.fixture(scope="module")
def layer_case(smollm2_dir, smollm2_tokenizer):
    """(float decoder layer, its calibration inputs and kwargs, held-out inputs) from the real model."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    calib_ids = calibration_batch(smollm2_tokenizer, CalibrationConfig(num_samples=4, seq_len=128))
    held_ids = torch.tensor(perplexity_tokens(smollm2_tokenizer)[:512]).view(4, 128)
    with torch.no_grad():
        _, kwargs = _first_layer_inputs(model, calib_ids)
        calib = model(calib_ids, output_hidden_states=True, use_cache=False).hidden_states[LAYER]
        held = model(held_ids, output_hidden_states=True, use_cache=False).hidden_states[LAYER]
    return model.model.layers[LAYER], kwargs, calib, held


def _linear(layer, name):
    return getattr(layer.self_attn if name in LINEARS[:4] else layer.mlp, name)


@torch.no_grad()
def _relative_error(layer_case, quantize) -> float:
    """``|| f_q(x) - f(x) ||^2 / || f(x) - x ||^2`` of the layer on held-out text (its residual update)."""
    layer, kwargs, calib, held = layer_case
    quantized = copy.deepcopy(layer)
    inputs: dict[str, torch.Tensor] = {}
    _run_layer(quantized, calib, kwargs, record=inputs)
    quantize(quantized, inputs)
    reference = _run_layer(layer, held, kwargs)
    return ((_run_layer(quantized, held, kwargs) - reference).pow(2).sum() / (reference - held).pow(2).sum()).item()


def _round_to_nearest(layer, inputs, group_size=64):
    for name in LINEARS:
        linear = _linear(layer, name)
        linear.weight.copy_(packing.dequantize(*awq.round_to_nearest(linear.weight, group_size)).t())


def test_packaged_linears_sit_on_a_q4_1_grid(layer_case):
    """Every block of 32 input channels holds at most 16 values ``m + d q`` (q = 0..15), and the quantize
    command knows (it warns that the error compounds)."""
    assert quantized_source_types(resolve_model("smollm2-135m-instruct")) == {"Q4_1"}
    weight = _linear(layer_case[0], "down_proj").weight.detach().double()
    blocks = weight.reshape(weight.shape[0], -1, 32)
    low, step = blocks.amin(-1, keepdim=True), (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15
    codes = (blocks - low) / step
    assert (codes - codes.round()).abs().max() < 1e-3
    offset = low / step                                   # the grid's zero point, in steps
    assert (offset - offset.round()).abs().mean() > 0.2   # fractional: an integer zero point cannot match it


@pytest.mark.parametrize("method, bound", [("gptq", 0.8), ("awq", 0.7)])
def test_calibrated_quantization_beats_round_to_nearest_on_held_out_text(layer_case, method, bound):
    rtn = _relative_error(layer_case, _round_to_nearest)
    if method == "gptq":
        config = QuantizationConfig("gptq", group_size=64, zero_point=False, sym=True, desc_act=True)
        error = _relative_error(layer_case, lambda layer, inputs: _gptq_layer(layer, inputs, config))
    else:
        error = _relative_error(layer_case, lambda layer, inputs: awq.quantize_layer(layer, inputs, 64, n_grid=10))
    print(f"{method}: relative error {error:.4f}, round-to-nearest {rtn:.4f}")
    assert error < bound * rtn


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_calibrated_methods_report_less_layer_error_than_round_to_nearest(method, tmp_path, smollm2_tokenizer):
    """``quantize_model``'s layer report (tiny random model): every projection type of the calibrated method
    has a smaller output error on its calibration activations than round-to-nearest in the same format, and the
    round-to-nearest checkpoint holds exactly the min-max rounded weights."""
    from safetensors import safe_open

    from .conftest import make_tiny_model
    model = make_tiny_model("llama", tmp_path / "model", smollm2_tokenizer)
    calibration = CalibrationConfig(num_samples=2, seq_len=64, awq_grid=6)
    errors = {}
    for rtn in (True, False):
        held_out = torch.randint(100, 40000, (2, 32), generator=torch.Generator().manual_seed(0))
        errors[rtn] = LayerErrors(held_out_ids=held_out)
        out = quantize_model(str(model), tmp_path / f"{method}-{rtn}", method, calibration=calibration,
                             round_to_nearest=rtn, layer_errors=errors[rtn])
    assert set(errors[True].by_type()) == set(LINEARS) and len(errors[True].by_layer()["q_proj"]) == 2
    for name, rtn_error in errors[True].by_type().items():
        assert 0 < errors[False].by_type()[name] < rtn_error, name
    for split in ("calibration", "held_out"):
        assert len(errors[True].residual_by_layer(split)) == 2 and min(errors[True].residual_by_layer(split)) > 0
    assert sum(errors[False].residual_by_layer("calibration")) < sum(errors[True].residual_by_layer("calibration"))
    from transformers import AutoModelForCausalLM
    weight = AutoModelForCausalLM.from_pretrained(model).model.layers[1].mlp.down_proj.weight.detach()
    codes, scales, zeros, g_idx = awq.round_to_nearest(weight, 64, sym=method == "gptq")
    with safe_open(str(tmp_path / f"{method}-True" / "model.safetensors"), framework="pt") as handle:
        qweight = handle.get_tensor("model.layers.1.mlp.down_proj.qweight")
    expected = packing.pack_awq(codes) if method == "awq" else packing.pack_gptq_qweight(codes)
    assert torch.equal(qweight, expected)
