"""AWQ/GPTQ on-disk layouts, the quantized linear layer, the algorithms and FP8 numerics, on CPU."""
from __future__ import annotations

import pytest
import torch

from inference.errors import InvalidRequestError, ModelLoadError
from inference.quantization import QuantizationConfig, resolve_quantization, weight_memory
from inference.quantization import awq, gptq, packing
from inference.quantization.fp8 import Fp8Activation, Fp8LinearMethod, check_fp8_supported, quantize_fp8_rowwise
from inference.quantization.linear import QuantizedLinear, make_linear_method
from inference.quantization.quantize import pack_linear


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _nibble(word: int, slot: int) -> int:
    return (word >> (4 * slot)) & 0xF


def test_awq_qweight_interleaves_columns_as_published():
    codes = torch.randint(0, 16, (3, 16), dtype=torch.int32)
    packed = packing.pack_awq(codes)
    assert packed.shape == (3, 2) and packed.dtype == torch.int32
    for row in range(3):
        for col in range(2):
            word = int(packed[row, col]) & 0xFFFFFFFF
            assert [_nibble(word, i) for i in range(8)] == [int(codes[row, 8 * col + j]) for j in (0, 2, 4, 6, 1, 3, 5, 7)]
    assert torch.equal(packing.unpack_awq(packed), codes)


def test_gptq_qweight_packs_input_rows_and_qzeros_store_zero_minus_one():
    codes = torch.randint(0, 16, (16, 3), dtype=torch.int32)
    packed = packing.pack_gptq_qweight(codes)
    assert packed.shape == (2, 3)
    word = int(packed[1, 2]) & 0xFFFFFFFF
    assert [_nibble(word, i) for i in range(8)] == codes[8:16, 2].tolist()
    assert torch.equal(packing.unpack_gptq_qweight(packed), codes)
    g_idx = packing.group_index(16, 8)
    tensors = pack_linear("gptq", codes, torch.ones(2, 8), torch.full((2, 8), 8, dtype=torch.int32), g_idx)
    assert (tensors["qzeros"] & 0xFFFFFFFF == 0x77777777).all()  # symmetric zero 8 stored as 7 (v1)


def _checkpoint_linear(method: str, weight: torch.Tensor, group_size: int, H: torch.Tensor, desc_act: bool):
    """Quantize ``weight [N, K]`` like ``manage.py quantize`` and return (tensors on disk, dense reference [K, N])."""
    if method == "awq":
        codes, scales, zeros, g_idx = awq.round_to_nearest(weight, group_size)
    else:
        codes, scales, zeros, g_idx = gptq.gptq_quantize(weight, H, group_size, desc_act=desc_act)
    return pack_linear(method, codes, scales, zeros, g_idx), packing.dequantize(codes, scales.half(), zeros, g_idx)


@pytest.mark.parametrize("method, group_size, desc_act", [("awq", 32, False), ("awq", -1, False),
                                                          ("gptq", 32, False), ("gptq", 32, True),
                                                          ("gptq", -1, True)])
def test_fused_quantized_linear_loads_shards_and_matches_dense(method, group_size, desc_act, monkeypatch):
    K, shards = 64, {"q_proj": 48, "k_proj": 16, "v_proj": 16}
    config = QuantizationConfig(method, group_size=group_size, zero_point=method == "awq", desc_act=desc_act)
    layer = QuantizedLinear(K, sum(shards.values()), False, make_linear_method(config), torch.float32, shards)
    references = []
    H = gptq.hessian(torch.randn(256, K) * torch.rand(K) * 3)  # Q/K/V read the same inputs: one Hessian
    for shard, rows in shards.items():
        tensors, dense = _checkpoint_linear(method, torch.randn(rows, K) * 0.05, group_size, H, desc_act)
        if desc_act and group_size != -1:
            assert not torch.equal(tensors["g_idx"], packing.group_index(K, group_size))  # groups scattered
        for name, tensor in tensors.items():
            layer.load_shard(shard, name, tensor)
        references.append(dense)
    layer.method.process_weights_after_loading(layer)
    x = torch.randn(5, K)
    expected = x @ torch.cat(references, dim=1)

    def no_dequantize(*args, **kwargs):
        raise AssertionError("a CPU layer dequantized its weights in a forward pass")
    with monkeypatch.context() as patch:  # held dequantized from load: a step does not dequantize again
        patch.setattr(packing, "dequantize", no_dequantize)
        patch.setattr(packing, "dequantize_internal", no_dequantize)
        torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)
    # activations of another dtype than the layer's still get the right product (dequantized for the call)
    torch.testing.assert_close(layer(x.double()), expected.double(), rtol=1e-4, atol=1e-4)


def test_fused_gptq_shards_with_different_g_idx_are_refused():
    config = QuantizationConfig("gptq", group_size=32, zero_point=False, desc_act=True)
    layer = QuantizedLinear(64, 32, False, make_linear_method(config), torch.float32, {"gate_proj": 16, "up_proj": 16})
    g_idx = packing.group_index(64, 32)
    layer.load_shard("gate_proj", "g_idx", g_idx)
    with pytest.raises(ValueError, match="g_idx differs"):
        layer.load_shard("up_proj", "g_idx", g_idx.flip(0))


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    K, N = 128, 64
    x = torch.randn(1024, K) @ torch.randn(K, K) * 0.2 + torch.randn(K) * 2
    w = torch.randn(N, K) * 0.05
    reference = x @ w.t()
    rtn = packing.dequantize(*awq.round_to_nearest(w, 32, sym=True))
    q = packing.dequantize(*gptq.gptq_quantize(w, gptq.hessian(x), 32, sym=True, desc_act=True))
    err_rtn = (x @ rtn - reference).pow(2).mean()
    err_gptq = (x @ q - reference).pow(2).mean()
    assert err_gptq < 0.7 * err_rtn


def test_awq_scales_keep_the_float_model_and_cut_the_quantized_error():
    K, N = 128, 96
    x = torch.randn(512, K)
    x[:, :4] *= 30  # salient input channels, as in the paper
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter(torch.ones(K), requires_grad=False)
    linear = torch.nn.Linear(K, N, bias=False)
    torch.nn.init.normal_(linear.weight, 0, 0.05)
    before = x @ linear.weight.detach().t()
    rtn_err = (x @ awq.fake_quantize(linear.weight.detach(), 32).t() - before).pow(2).mean()
    s = awq.search_scales(x, [linear], 32)
    awq.apply_scales(s, norm, [linear])
    x_scaled = x * norm.weight
    torch.testing.assert_close(x_scaled @ linear.weight.detach().t(), before, rtol=1e-4, atol=1e-3)
    awq_err = (x_scaled @ awq.fake_quantize(linear.weight.detach(), 32).t() - before).pow(2).mean()
    assert awq_err < 0.8 * rtn_err


def test_fp8_rowwise_quantization_error_is_within_e4m3_precision():
    x = torch.randn(16, 64) * torch.logspace(-3, 2, 16)[:, None]
    codes, scales = quantize_fp8_rowwise(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (16, 1)
    back = codes.float() * scales
    big = x.abs() > scales * 2 ** -6 * 8  # normal range of e4m3: relative error at most 2^-4
    assert ((back - x).abs()[big] <= x.abs()[big] * 2 ** -4 + 1e-12).all()


def _fp8_layer(dtype: torch.dtype):
    """An FP8 linear layer 64 -> 32 with a bias, quantized at load: ``(layer, w, b)`` (the float32 originals)."""
    layer = QuantizedLinear(64, 32, True, Fp8LinearMethod(), dtype)
    w, b = torch.randn(32, 64) * 0.05, torch.randn(32) * 0.1
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    layer.method.process_weights_after_loading(layer)
    return layer, w, b


def test_fp8_linear_reference_tracks_the_dense_layer():
    layer, w, b = _fp8_layer(torch.float32)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (32,)
    x = torch.randn(7, 64)
    expected = x @ w.t() + b
    rel = (layer(x) - expected).norm() / expected.norm()
    assert rel < 0.05


_FP8_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
                          else [])


@pytest.mark.parametrize("device", _FP8_DEVICES)
def test_fp8_layer_takes_an_activation_quantized_by_its_producer(device):
    """A norm or SwiGLU kernel may hand the layer its per-token codes (Fp8Activation): same output as the
    16-bit input, bias included (on the GPU it is added in the scaled GEMM's epilogue)."""
    layer, w, b = _fp8_layer(torch.bfloat16)
    layer.to(device)
    assert layer.takes_fp8_activations
    x = torch.randn(7, 64, device=device).to(torch.bfloat16)
    expected = layer(x)
    got = layer(Fp8Activation(*quantize_fp8_rowwise(x), torch.bfloat16))
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    dense = x.float() @ w.t().to(device) + b.to(device)
    assert (got.float() - dense).norm() / dense.norm() < 0.05


def test_fp8_without_fp8_tensor_cores_names_the_requirement():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine has FP8 tensor cores")
    with pytest.raises(InvalidRequestError, match=r"needs a GPU with FP8 tensor cores \(compute capability >= 8.9") as err:
        check_fp8_supported("cuda" if torch.cuda.is_available() else "cpu")
    assert err.value.param == "quantization"


def _hf_config(**extra):
    from types import SimpleNamespace
    return SimpleNamespace(**extra)


def test_quantization_config_detection_and_errors():
    awq_ckpt = _hf_config(quantization_config={"quant_method": "awq", "bits": 4, "group_size": 64,
                                               "zero_point": True, "version": "gemm"})
    assert resolve_quantization(None, awq_ckpt) == QuantizationConfig("awq", group_size=64)
    assert resolve_quantization("awq", awq_ckpt).group_size == 64
    with pytest.raises(InvalidRequestError, match="contradicts the checkpoint") as err:
        resolve_quantization("gptq", awq_ckpt)
    assert err.value.param == "quantization"
    with pytest.raises(InvalidRequestError, match="must be one of awq, gptq, fp8"):
        resolve_quantization("int3", _hf_config())
    with pytest.raises(InvalidRequestError, match="needs a GPTQ checkpoint"):
        resolve_quantization("gptq", _hf_config())
    with pytest.raises(ModelLoadError, match="only 4-bit"):
        resolve_quantization(None, _hf_config(quantization_config={"quant_method": "gptq", "bits": 8}))
    gptq_ckpt = _hf_config(quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                "desc_act": True, "sym": True, "checkpoint_format": "gptq"})
    found = resolve_quantization(None, gptq_ckpt)
    assert (found.method, found.desc_act, found.sym) == ("gptq", True, True)
    assert resolve_quantization(None, _hf_config()) is None
    assert resolve_quantization("fp8", _hf_config()).method == "fp8"


def test_group_size_that_does_not_divide_a_layer_is_a_clear_error():
    config = QuantizationConfig("awq", group_size=128)
    with pytest.raises(ModelLoadError, match="group_size=128 does not fit a linear layer of 576 input"):
        QuantizedLinear(576, 64, False, make_linear_method(config), torch.float16)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_qwen25_7b_quantized_weights_take_at_most_30_percent_of_bf16(method):
    """Built on the meta device: nothing is allocated. Embeddings and the LM head stay 16-bit (as in
    published checkpoints), so the bound holds for the quantized linear layers; the whole model is reported."""
    from inference.model_loader import load_hf_config, resolve_model
    from inference.models.registry import SUPPORTED_ARCHITECTURES, architecture_of
    from inference.quantization import quantize_linear_layers

    hf = load_hf_config(resolve_model("qwen2.5-7b", load_format="dummy").model_dir)
    arch = architecture_of(hf)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = SUPPORTED_ARCHITECTURES[arch](hf, arch, 4096)
            replaced = quantize_linear_layers(model, resolve_quantization(method, hf, "dummy"))
    finally:
        torch.set_default_dtype(previous)
    assert replaced == 4 * hf.num_hidden_layers
    memory = weight_memory(model)
    assert memory.quantized_bf16_bytes > 12e9  # the 6.5 B parameters of the linear layers
    assert memory.quantized_ratio <= 0.30
    assert memory.total_ratio < 0.40
