"""The Triton W4A16 kernel against dequantize-then-matmul (its reference and the CPU path).

Without a CUDA device the kernel runs in Triton's interpreter on tiny shapes.
"""
from __future__ import annotations

import pytest
import torch

from .triton_interpreter import HAS_CUDA  # noqa: E402  (sets TRITON_INTERPRET=1 without a GPU)

triton = pytest.importorskip("triton")

from inference.quantization import QuantizationConfig, packing  # noqa: E402
from inference.quantization.int4 import Int4LinearMethod  # noqa: E402
from inference.quantization.linear import QuantizedLinear  # noqa: E402
from inference.quantization.triton_w4a16 import tile_config, w4a16_matmul  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _random_int4(K: int, N: int, group_size: int):
    codes = torch.randint(0, 16, (K, N), dtype=torch.int32)
    groups = K // group_size
    scales = (torch.rand(groups, N) * 0.01 + 0.001).half()
    zeros = torch.randint(0, 16, (groups, N), dtype=torch.int32)
    g_idx = packing.group_index(K, group_size)
    dense = packing.dequantize(codes, scales, zeros, g_idx)
    return (packing.pack_gptq_qweight(codes).to(DEVICE), scales.to(DEVICE), packing.pack_cols(zeros).to(DEVICE),
            dense.to(DEVICE))


@pytest.mark.parametrize("M", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K, N, group_size", [(64, 32, 32), (64, 48, 64)])
def test_w4a16_kernel_matches_dequantize_then_matmul(M, dtype, K, N, group_size):
    torch.manual_seed(M)
    qweight, scales, qzeros, dense = _random_int4(K, N, group_size)
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    expected = (x.float() @ dense.to(dtype).float()).to(dtype)
    out = w4a16_matmul(x, qweight, scales, qzeros, group_size, num_sms=1)
    assert out.dtype == dtype and out.shape == (M, N)
    torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype])


def test_w4a16_split_k_partial_sums_add_up():
    K, N, group_size = 128, 32, 32
    block_m, block_n, block_k, split_k = tile_config(1, N, K, group_size, num_sms=64)
    assert split_k > 1  # decode on a wide GPU splits K
    qweight, scales, qzeros, dense = _random_int4(K, N, group_size)
    x = torch.randn(1, K, device=DEVICE)
    out = w4a16_matmul(x, qweight, scales, qzeros, group_size, num_sms=64)
    torch.testing.assert_close(out, x @ dense, atol=1e-4, rtol=1e-4)


def test_quantized_linear_apply_uses_the_kernel_layout_for_awq_checkpoints():
    """An AWQ layer repacked at load gives the same result through the kernel as the reference."""
    K, N, group_size = 64, 32, 32
    config = QuantizationConfig("awq", group_size=group_size)
    layer = QuantizedLinear(K, N, False, Int4LinearMethod(config), torch.float32)
    codes = torch.randint(0, 16, (K, N), dtype=torch.int32)
    zeros = torch.randint(0, 16, (K // group_size, N), dtype=torch.int32)
    scales = (torch.rand(K // group_size, N) * 0.01).half()
    with torch.no_grad():
        layer.qweight.copy_(packing.pack_awq(codes))
        layer.qzeros.copy_(packing.pack_awq(zeros))
        layer.scales.copy_(scales)
    layer.method.process_weights_after_loading(layer)
    layer.to(DEVICE)
    x = torch.randn(3, K, device=DEVICE)
    dense = packing.dequantize(codes, scales, zeros, packing.group_index(K, group_size)).to(DEVICE)
    out = w4a16_matmul(x, layer.qweight, layer.scales, layer.qzeros, layer.group_size, num_sms=1)
    torch.testing.assert_close(out, x @ dense, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(layer(x), x @ dense, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_kernel_reads_each_rows_group_for_act_order_shards(dtype):
    """A row-parallel rank of a GPTQ act-order layer: its 128 rows in checkpoint order point at groups
    all over the full layer (8 groups of 32), whose scales and zero points it keeps whole."""
    torch.manual_seed(3)
    K, N, num_groups = 128, 48, 8
    codes = torch.randint(0, 16, (K, N), dtype=torch.int32)
    scales = (torch.rand(num_groups, N) * 0.01 + 0.001).half()
    zeros = torch.randint(0, 16, (num_groups, N), dtype=torch.int32)
    row_groups = torch.randint(0, num_groups, (K,), dtype=torch.int32)
    dense = packing.dequantize(codes, scales, zeros, row_groups).to(DEVICE)
    x = torch.randn(5, K, device=DEVICE).to(dtype)
    out = w4a16_matmul(x, packing.pack_gptq_qweight(codes).to(DEVICE), scales.to(DEVICE),
                       packing.pack_cols(zeros).to(DEVICE), 32, num_sms=4, row_groups=row_groups.to(DEVICE))
    expected = (x.float() @ dense.to(dtype).float()).to(dtype)
    torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype])
