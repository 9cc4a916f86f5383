"""The Triton W4A16 kernels (split-K decode GEMV, tiled GEMM, and the dequantize kernel of the large-M
path) against dequantize-then-matmul (their reference and the CPU path), on the AWQ and GPTQ layouts
repacked at load.

Without a CUDA device the kernels run in Triton's interpreter on tiny shapes.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from .triton_interpreter import HAS_CUDA  # noqa: E402  (sets TRITON_INTERPRET=1 without a GPU)

triton = pytest.importorskip("triton")

from inference.quantization import QuantizationConfig, packing  # noqa: E402
from inference.quantization.int4 import Int4LinearMethod  # noqa: E402
from inference.quantization.linear import QuantizedLinear  # noqa: E402
from inference.quantization.triton_w4a16 import w4a16_gemm, w4a16_matmul  # noqa: E402
from inference.quantization.triton_w4a16_decode import w4a16_decode  # noqa: E402
from inference.quantization.triton_w4a16_gemv import w4a16_gemv  # noqa: E402
from inference.quantization.triton_w4a16_launch import (DecodeConfig, decode_config, fit_config,  # noqa: E402
                                                        gemv_config)
from inference.quantization import triton_w4a16_dequant  # noqa: E402
from inference.quantization.triton_w4a16_dequant import dequant_matmul, dequantize_w4a16  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _random_int4(K: int, N: int, group_size: int):
    """Internal-layout tensors of random codes, and the dense ``[K, N]`` float32 weights they stand for."""
    codes = torch.randint(0, 16, (K, N), dtype=torch.int32)
    groups = K // group_size
    scales = (torch.rand(groups, N) * 0.01 + 0.001).half()
    zeros = torch.randint(0, 16, (groups, N), dtype=torch.int32)
    dense = packing.dequantize(codes, scales, zeros, packing.group_index(K, group_size))
    return (packing.pack_ktiled(codes).to(DEVICE), scales.to(DEVICE), packing.pack_cols(zeros).to(DEVICE),
            dense.to(DEVICE))


def test_ktiled_packing_round_trips_and_pairs_consecutive_rows_in_the_two_halves_of_a_word():
    codes = torch.randint(0, 16, (200, 8), dtype=torch.int32)   # 2 tiles of 128, the second padded
    packed = packing.pack_ktiled(codes)
    assert packed.shape == (32, 8)
    word = int(packed[16 + 8 + 3, 5]) & 0xFFFFFFFF              # tile 1, half h = 1, pair p = 3
    for j in range(4):                                          # chunk 4h + j: rows 2p, 2p + 1 of it
        row = 128 + 16 * (4 + j) + 6
        expected = [int(codes[r, 5]) if r < 200 else 0 for r in (row, row + 1)]
        assert [(word >> (4 * j)) & 0xF, (word >> (16 + 4 * j)) & 0xF] == expected
    assert torch.equal(packing.unpack_ktiled(packed, 200), codes)


# K 320 and 192 are not multiples of the 128-row tile; group 192 straddles tiles; M 17 takes 32-row blocks,
# M 40 and 64 64-row blocks.
@pytest.mark.parametrize("M, K, N, group_size, split_k, dtype, block_n", [
    (1, 256, 64, 128, 1, torch.float32, 32),
    (1, 384, 80, 128, 2, torch.bfloat16, 64),
    (1, 256, 64, 128, 2, torch.float16, 32),
    (1, 320, 96, 32, 2, torch.bfloat16, 32),
    (17, 320, 64, 64, 3, torch.float32, 32),
    (5, 384, 64, 192, 2, torch.bfloat16, 32),
    (32, 128, 32, 128, 1, torch.bfloat16, 32),
    (8, 256, 128, 256, 2, torch.float16, 128),
    (1, 1024, 64, 256, 2, torch.bfloat16, 64),   # four tiles a split over two groups of 256: the prefetched group
    (40, 256, 64, 128, 2, torch.bfloat16, 64),
    (64, 384, 32, 128, 2, torch.float16, 32),
])
# groups of 128 and 256 take the one-MMA-per-tile kernel, its zero point subtracted in registers, or after the MMA
# with each tile's sum(x) from a second MMA or from the x tile
@pytest.mark.parametrize("tile_mma, zero_in_regs, x_sums", [(False, False, False), (True, False, False),
                                                             (True, False, True), (True, True, False)])
def test_decode_kernel_matches_dequantize_then_matmul(M, K, N, group_size, split_k, dtype, block_n, tile_mma,
                                                      zero_in_regs, x_sums):
    torch.manual_seed(M + K)
    qweight, scales, qzeros, dense = _random_int4(K, N, group_size)
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    bias = torch.randn(N, device=DEVICE).to(dtype)
    expected = x.float() @ dense.to(dtype).float() + bias.float()
    out = w4a16_decode(x, qweight, scales, qzeros, group_size, bias=bias,
                       config=DecodeConfig(block_n, split_k, tile_mma=tile_mma, zero_in_regs=zero_in_regs,
                                           x_sums=x_sums))
    assert out.dtype == dtype and out.shape == (M, N)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


@pytest.mark.parametrize("M", [3, 1])
@pytest.mark.parametrize("tile_mma, x_sums, dtype", [(False, False, torch.float32), (True, False, torch.float32),
                                                     (True, True, torch.bfloat16)])
def test_decode_kernel_gathers_act_order_columns_and_leaves_its_counters_at_zero(M, tile_mma, x_sums, dtype):
    K, N, group_size = 256, 64, 128
    qweight, scales, qzeros, dense = _random_int4(K, N, group_size)
    perm = torch.randperm(K, device=DEVICE)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    config = DecodeConfig(32, 2, tile_mma=tile_mma, zero_in_regs=not x_sums, x_sums=x_sums)
    for _ in range(2):  # the second call finds the counters the first one left
        out = w4a16_decode(x, qweight, scales, qzeros, group_size, perm=perm, counters=counters, config=config)
        torch.testing.assert_close(out.float(), x[:, perm].float() @ dense.to(dtype).float(), **TOL[dtype])
    assert counters.count_nonzero() == 0


@pytest.mark.parametrize("x_sums, prefetch, x_in_loop", [(False, False, False), (True, False, False),
                                                          (True, True, True), (False, True, True)])
def test_decode_tile_kernel_loop_variants_match_the_reference(x_sums, prefetch, x_in_loop):
    """The sweep's variants of the tile kernel's loop: each tile's group parameters loaded in its own iteration
    (no prefetch), each x tile loaded at the top of its iteration (``x_in_loop``)."""
    K, N, group_size = 768, 64, 128
    qweight, scales, qzeros, dense = _random_int4(K, N, group_size)
    x = torch.randn(2, K, device=DEVICE).to(torch.float16)
    config = DecodeConfig(32, 2, tile_mma=True, zero_in_regs=not x_sums, x_sums=x_sums, prefetch=prefetch,
                          x_in_loop=x_in_loop)
    out = w4a16_decode(x, qweight, scales, qzeros, group_size, config=config)
    torch.testing.assert_close(out.float(), x.float() @ dense.half().float(), **TOL[torch.float16])


# The CUDA-core GEMV kernel: 1-4 rows (3 pads to a 4-row block), N not a multiple of the tile (80), groups of
# 256 over two splits, each with and without the next tile's loads issued one iteration ahead
@pytest.mark.parametrize("M, K, N, group_size, split_k, dtype, block_n", [
    (1, 256, 64, 128, 1, torch.float32, 32),
    (1, 384, 80, 128, 2, torch.bfloat16, 64),
    (2, 1024, 64, 256, 2, torch.float16, 64),
    (3, 512, 96, 128, 3, torch.bfloat16, 32),
    (4, 256, 128, 128, 2, torch.float16, 128),
])
@pytest.mark.parametrize("prefetch", [True, False])
def test_gemv_kernel_matches_dequantize_then_matmul(M, K, N, group_size, split_k, dtype, block_n, prefetch):
    torch.manual_seed(M + K + N)
    qweight, scales, qzeros, dense = _random_int4(K, N, group_size)
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    bias = torch.randn(N, device=DEVICE).to(dtype)
    out = w4a16_decode(x, qweight, scales, qzeros, group_size, bias=bias,
                       config=DecodeConfig(block_n, split_k, gemv=True, prefetch=prefetch))
    assert out.dtype == dtype and out.shape == (M, N)
    torch.testing.assert_close(out.float(), x.float() @ dense.to(dtype).float() + bias.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemv_kernel_gathers_act_order_columns_and_leaves_its_counters_at_zero(dtype):
    K, N, group_size = 384, 64, 128
    qweight, scales, qzeros, dense = _random_int4(K, N, group_size)
    perm = torch.randperm(K, device=DEVICE)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    x = torch.randn(2, K, device=DEVICE).to(dtype)
    for _ in range(2):  # the second call finds the counters the first one left
        out = w4a16_decode(x, qweight, scales, qzeros, group_size, perm=perm, counters=counters,
                           config=DecodeConfig(32, 3, gemv=True))
        torch.testing.assert_close(out.float(), x[:, perm].float() @ dense.to(dtype).float(), **TOL[dtype])
    assert counters.count_nonzero() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_kernel_reads_activations_at_an_odd_offset(dtype):
    """Two 16-bit activations travel in one 32-bit load; a row slice starting at an odd column (not 4-byte
    aligned, odd row stride) must still be read right."""
    K, N = 256, 64
    qweight, scales, qzeros, dense = _random_int4(K, N, 128)
    wide = torch.randn(2, K + 3, device=DEVICE).to(dtype)
    x = wide[:, 1:K + 1]
    assert x.data_ptr() % 4 and x.stride(0) % 2
    out = w4a16_decode(x, qweight, scales, qzeros, 128, config=DecodeConfig(32, 2, gemv=True))
    torch.testing.assert_close(out.float(), x.float() @ dense.to(dtype).float(), **TOL[dtype])


def test_gemv_kernel_names_its_row_and_group_limits():
    qweight, scales, qzeros, dense = _random_int4(256, 32, 64)
    with pytest.raises(ValueError, match=r"at most 4 rows \(got 5\)"):
        w4a16_gemv(torch.randn(5, 256, device=DEVICE), qweight, scales, qzeros, 64, DecodeConfig(32, 1))
    with pytest.raises(ValueError, match=r"group size \(got 64\) and input features \(got 256\) that are multiples"):
        w4a16_gemv(torch.randn(1, 256, device=DEVICE), qweight, scales, qzeros, 64, DecodeConfig(32, 1))
    # through the decode entry point, rows, groups and K it cannot take go to the MMA kernels
    x = torch.randn(5, 256, device=DEVICE)
    out = w4a16_decode(x, qweight, scales, qzeros, 64, config=DecodeConfig(32, 1, gemv=True))
    torch.testing.assert_close(out, x @ dense, **TOL[torch.float32])
    qweight, scales, qzeros, dense = _random_int4(320, 32, 64)   # K = 320: the last tile half padding
    x = torch.randn(1, 320, device=DEVICE)
    out = w4a16_decode(x, qweight, scales, qzeros, 64, config=DecodeConfig(32, 2, gemv=True))
    torch.testing.assert_close(out, x @ dense, **TOL[torch.float32])
    assert w4a16_decode(x[:0], qweight, scales, qzeros, 64, config=DecodeConfig(32, 2, gemv=True)).shape == (0, 32)
    with pytest.raises(ValueError, match="x has 384 input features"):
        w4a16_decode(torch.randn(1, 384, device=DEVICE), qweight, scales, qzeros, 64)


def test_decode_kernels_lop3_sets_the_mantissa_of_each_dtypes_offset():
    """The compiled path ORs each code into ``OFFSET``'s mantissa with one ``lop3`` (``_code_pairs``), which the
    interpreter never runs: its constants and truth table must give ``(w & 0x000F000F) | OFFSET`` bits in both
    halves for the dtype whose ``MAGIC`` selects it."""
    import inspect
    import re

    from inference.quantization import triton_w4a16_decode as decode
    from inference.quantization import triton_w4a16_operand as operand
    source = inspect.getsource(operand._code_pairs.fn)
    found = re.findall(r'lop3\.b32 \$0, \$1, (0x[0-9A-Fa-f]+), (0x[0-9A-Fa-f]+), (0x[0-9A-Fa-f]+);', source)
    assert len(found) == 2
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (1000,), dtype=torch.int64).tolist()
    for (mask, constant, lut), dtype in zip(found, (torch.bfloat16, torch.float16)):
        mask, constant, lut = int(mask, 16), int(constant, 16), int(lut, 16)
        magic, offset = decode._CODE_OFFSET[dtype]
        for w in words:
            assert _lop3(w & 0xFFFFFFFF, mask, constant, lut) == (w & 0xFFFFFFFF & 0x000F000F) | (magic * 0x10001)
        low = torch.tensor([magic | 5], dtype=torch.int16).view(dtype)   # code 5 in the low half
        assert float(low) == offset + 5


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX ``lop3.b32``: bit i of the result is bit ``a_i << 2 | b_i << 1 | c_i`` of ``lut``."""
    out = 0
    for bit in range(32):
        out |= ((lut >> (((a >> bit) & 1) << 2 | ((b >> bit) & 1) << 1 | ((c >> bit) & 1))) & 1) << bit
    return out


def test_gemv_kernels_lop3_puts_each_nibble_in_a_float32_mantissa():
    """The GEMV kernel's compiled path (``_slot``, which the interpreter never runs) keeps nibble i of a word in
    place and ORs in 2^23's exponent: the float32 is 2^23 + code * 16^i, for i = 0..3 in that order."""
    import inspect
    import re

    from inference.quantization import triton_w4a16_gemv as gemv
    found = re.findall(r'lop3\.b32 \$0, \$1, (0x[0-9A-Fa-f]+), (0x[0-9A-Fa-f]+), (0x[0-9A-Fa-f]+);',
                       inspect.getsource(gemv._slot.fn))
    assert len(found) == 4
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (300,), dtype=torch.int64).tolist()
    for i, (mask, constant, lut) in enumerate(found):
        for w in words:
            bits = _lop3(w & 0xFFFFFFFF, int(mask, 16), int(constant, 16), int(lut, 16))
            value = float(torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32))
            assert value == 2 ** 23 + ((w >> (4 * i)) & 0xF) * 16 ** i


def test_decode_config_takes_the_swept_variants_and_splits_k_more_for_thin_layers():
    """The kernels, variants and splits the H100 sweep chose (``decode_config``'s docstring)."""
    o_proj, down = decode_config(1, 3584, 3584, num_sms=132), decode_config(1, 3584, 18944, num_sms=132)
    gate_up = decode_config(1, 37888, 3584, num_sms=132)
    assert o_proj.gemv and down.gemv and not o_proj.prefetch  # one row of a narrow layer: the CUDA-core kernel
    assert not gate_up.gemv and not decode_config(2, 3584, 3584, num_sms=132).gemv  # not for wide layers, 2+ rows
    o_tiles = decode_config(8, 3584, 3584, num_sms=132)
    assert o_tiles.split_k > gate_up.split_k >= 1
    for config in (o_tiles, gate_up, decode_config(64, 3584, 3584, num_sms=132)):
        assert config.tile_mma and config.zero_in_regs and config.x_in_loop and config.block_n == 128
    wide = decode_config(32, 37888, 3584, num_sms=132)
    assert wide.split_k < gate_up.split_k or wide.split_k == 1  # partial sums cost more
    assert decode_config(2, 64, 256, num_sms=132).split_k == 1  # at least two K tiles per program


def test_gemv_config_fills_the_sms_and_gives_each_split_two_k_tiles():
    gate_up, o_proj = gemv_config(1, 37888, 3584, num_sms=132), gemv_config(1, 3584, 3584, num_sms=132)
    assert gate_up.gemv and gate_up.block_n == 128 and 37888 // 128 * gate_up.split_k >= 2 * 132
    assert o_proj.split_k == 14 and 28 * o_proj.split_k >= 2 * 132   # 28 K tiles: splits of two
    assert gemv_config(1, 64, 256, num_sms=132).split_k == 1


@pytest.mark.parametrize("M, K, group_size", [(40, 320, 64), (33, 256, 128)])
def test_gemm_kernel_matches_dequantize_then_matmul(M, K, group_size):
    torch.manual_seed(M)
    N = 64
    qweight, scales, qzeros, dense = _random_int4(K, N, group_size)
    x = torch.randn(M, K, device=DEVICE)
    out = w4a16_gemm(x, qweight, scales, qzeros, group_size, num_sms=4)
    torch.testing.assert_close(out, x @ dense, **TOL[torch.float32])


def _layer(method: str, K: int, N: int, group_size: int, desc_act: bool = False):
    """A ``QuantizedLinear`` loaded from random codes in the on-disk format of ``method``, and its dense
    ``[K, N]`` weights in the checkpoint's row order."""
    config = QuantizationConfig(method, group_size=group_size, desc_act=desc_act)
    layer = QuantizedLinear(K, N, True, Int4LinearMethod(config), torch.float32)
    codes = torch.randint(0, 16, (K, N), dtype=torch.int32)
    zeros = torch.randint(1, 16, (K // group_size, N), dtype=torch.int32)
    scales = (torch.rand(K // group_size, N) * 0.01).half()
    g_idx = packing.group_index(K, group_size)
    if desc_act:
        g_idx = g_idx[torch.randperm(K)]
    with torch.no_grad():
        if method == "awq":
            layer.qweight.copy_(packing.pack_awq(codes))
            layer.qzeros.copy_(packing.pack_awq(zeros))
        else:
            layer.qweight.copy_(packing.pack_gptq_qweight(codes))
            layer.qzeros.copy_(packing.pack_cols(zeros - 1))
            layer.g_idx.copy_(g_idx)
        layer.scales.copy_(scales)
        layer.bias.normal_()
    layer.method.process_weights_after_loading(layer)
    return layer, packing.dequantize(codes, scales, zeros, g_idx)


@pytest.mark.parametrize("method, desc_act", [("awq", False), ("gptq", False), ("gptq", True)])
@pytest.mark.parametrize("M", [1, 17, 80, 130])  # decode kernel (twice), GEMM, dequantize + matmul
def test_quantized_linear_through_the_kernels_matches_the_checkpoint(method, desc_act, M):
    """AWQ (interleaved nibbles) and GPTQ (with act-order's scattered groups) layers repacked at load
    give, through the kernels, the dense product of the checkpoint's weights plus the bias."""
    torch.manual_seed(M)
    layer, dense = _layer(method, 256, 64, 32, desc_act)
    assert (layer.perm is not None) == desc_act
    x = torch.randn(M, 256)
    expected = x @ dense + layer.bias.detach()
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)  # the CPU path
    if DEVICE == "cpu":  # the same layer through the kernels (the interpreter)
        perm = layer.perm
        out = w4a16_matmul(x, layer.qweight, layer.scales, layer.qzeros, layer.group_size, perm=perm,
                           bias=layer.bias, counters=layer.split_k_counters, num_sms=8)
    else:
        layer.to(DEVICE)
        layer.perm = None if layer.perm is None else layer.perm.to(DEVICE)
        out = layer(x.to(DEVICE)).cpu()
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


def _act_order_shard(K: int = 160, N: int = 48, num_groups: int = 8):
    """Internal-layout tensors ``(qweight, scales, qzeros, row_groups)`` of a row-parallel GPTQ act-order
    shard (rows in checkpoint order, each pointing at one of ``num_groups`` groups of 32), and its dense
    ``[K, N]`` float32 weights."""
    codes = torch.randint(0, 16, (K, N), dtype=torch.int32)
    scales = (torch.rand(num_groups, N) * 0.01 + 0.001).half()
    zeros = torch.randint(0, 16, (num_groups, N), dtype=torch.int32)
    row_groups = torch.randint(0, num_groups, (K,), dtype=torch.int32)
    tensors = (packing.pack_ktiled(codes), scales, packing.pack_cols(zeros), row_groups)
    return tuple(t.to(DEVICE) for t in tensors), packing.dequantize(codes, scales, zeros, row_groups).to(DEVICE)


@pytest.mark.parametrize("M", [5, 80, 130])  # 5 rows would take the decode kernel, which cannot read per-row groups
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_kernel_reads_each_rows_group_for_act_order_shards(M, dtype):
    """A row-parallel rank of a GPTQ act-order layer: its 160 rows in checkpoint order (K-tiled, the second
    tile partial) point at groups all over the full layer (8 groups of 32), whose scales and zero points
    it keeps whole."""
    torch.manual_seed(3)
    (qweight, scales, qzeros, row_groups), dense = _act_order_shard()
    K, N = dense.shape
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    bias = torch.randn(N, device=DEVICE).to(dtype)
    out = w4a16_matmul(x, qweight, scales, qzeros, 32, bias=bias, num_sms=4, row_groups=row_groups)
    expected = x.float() @ dense.to(dtype).float() + bias.float()
    assert out.dtype == dtype and out.shape == (M, N)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


# K 320: a partial last K tile; group 192 straddles tiles; 32 < 128 reads a group per row.
@pytest.mark.parametrize("K, N, group_size", [(320, 96, 32), (384, 64, 192), (256, 128, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_kernel_writes_the_reference_weights_in_linear_layout(K, N, group_size, dtype):
    torch.manual_seed(K + N)
    qweight, scales, qzeros, dense = _random_int4(K, N, group_size)
    expected = dense.to(dtype).t()                                     # [N, K], nn.Linear's layout
    assert torch.equal(dequantize_w4a16(qweight, scales, qzeros, group_size, K, dtype), expected)
    part = dequantize_w4a16(qweight, scales, qzeros, group_size, K, dtype, n_start=64, n_end=N)
    assert torch.equal(part, expected[64:])                            # a chunk of output columns


def test_dequantize_kernel_reads_each_rows_group_for_act_order_shards():
    torch.manual_seed(5)
    (qweight, scales, qzeros, row_groups), dense = _act_order_shard()
    out = dequantize_w4a16(qweight, scales, qzeros, 32, dense.shape[0], torch.float32, row_groups=row_groups)
    assert torch.equal(out, dense.t())


def test_dequant_matmul_in_column_chunks_matches_one_product(monkeypatch):
    """A layer larger than the scratch limit is dequantized and multiplied 64 columns at a time."""
    torch.manual_seed(7)
    K, N = 256, 192
    qweight, scales, qzeros, dense = _random_int4(K, N, 64)
    x = torch.randn(9, K, device=DEVICE)
    monkeypatch.setattr(triton_w4a16_dequant, "DEQUANT_CHUNK_BYTES", 64 * K * 4)
    assert triton_w4a16_dequant.chunk_columns(N, K, 4) == 64
    torch.testing.assert_close(dequant_matmul(x, qweight, scales, qzeros, 64), x @ dense, **TOL[torch.float32])


def test_large_row_counts_take_the_dequantize_path_and_smaller_ones_the_kernels(monkeypatch):
    """Rows from ``DEQUANT_MIN_ROWS`` on go through dequantize + matmul, fewer through the W4A16 kernels."""
    from inference.quantization import triton_w4a16
    calls = []
    monkeypatch.setattr(triton_w4a16, "dequant_matmul", lambda *a, **k: calls.append("dequant") or dequant_matmul(*a, **k))
    qweight, scales, qzeros, dense = _random_int4(128, 32, 128)
    for M in (80, triton_w4a16.DEQUANT_MIN_ROWS):
        x = torch.randn(M, 128, device=DEVICE)
        torch.testing.assert_close(w4a16_matmul(x, qweight, scales, qzeros, 128, num_sms=4), x @ dense,
                                   **TOL[torch.float32])
    assert calls == ["dequant"]
    w4a16_matmul(torch.randn(3, 128, device=DEVICE), qweight, scales, qzeros, 128, num_sms=4, dequant_min_rows=2)
    assert calls == ["dequant", "dequant"]


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the launches above compile the PTX path themselves")
def test_decode_kernels_packed_subtraction_compiles_for_hopper():
    """The interpreter runs the tile and GEMV kernels' element-by-element stand-ins for their inline PTX (``ASM``
    off); the PTX paths (bfloat16 and float16) must compile for sm_90 too."""
    from .triton_compile import compile_for_hopper, record_launches
    qweight, scales, qzeros, _ = _random_int4(256, 128, 128)
    launches = []
    configs = [DecodeConfig(128, 2, tile_mma=True, zero_in_regs=True),
               DecodeConfig(128, 2, tile_mma=True, zero_in_regs=False, x_sums=True),
               DecodeConfig(128, 2, tile_mma=True, zero_in_regs=False, x_sums=True, x_in_loop=True)]
    for dtype, config in itertools.product((torch.bfloat16, torch.float16), configs):
        with record_launches() as recorded:
            w4a16_decode(torch.randn(2, 256).to(dtype), qweight, scales, qzeros, 128, config=config)
        for launch in recorded:
            launch["args"]["ASM"] = {"const": True}
        launches += recorded
    for dtype, rows, prefetch in itertools.product((torch.bfloat16, torch.float16), (1, 2), (True, False)):
        with record_launches() as recorded:  # the GEMV kernel's lop3 path
            w4a16_decode(torch.randn(rows, 256).to(dtype), qweight, scales, qzeros, 128,
                         config=DecodeConfig(128, 2, gemv=True, prefetch=prefetch))
        for launch in recorded:
            launch["args"]["ASM"] = {"const": True}
        launches += recorded
    compile_for_hopper(launches)


@pytest.mark.skipif(HAS_CUDA, reason="compiles for another GPU than this one")
def test_default_decode_configs_fitted_to_an_a100_compile_for_sm80():
    """The sweep's choices use ``sub.bf16x2`` (sm_90 and later) and pipeline float32 x tiles into more shared
    memory than an sm_86 block has; ``fit_config`` gives an sm_80 GPU configs that compile and fit."""
    from .triton_compile import compile_for_hopper, record_launches
    qweight, scales, qzeros, _ = _random_int4(256, 128, 128)
    launches = []
    for dtype, rows in itertools.product((torch.bfloat16, torch.float16, torch.float32), (2, 8, 32)):
        config = fit_config(decode_config(rows, 128, 256, num_sms=108), dtype, (8, 0))
        assert not (dtype == torch.bfloat16 and config.zero_in_regs) and not (dtype == torch.float32 and
                                                                              config.x_in_loop)
        assert fit_config(config, dtype, (9, 0)) == config
        with record_launches() as recorded:
            w4a16_decode(torch.randn(rows, 256).to(dtype), qweight, scales, qzeros, 128, config=config)
        for launch in recorded:
            launch["args"]["ASM"] = {"const": True}
        launches += recorded
    compile_for_hopper(launches, arch=80)
    assert fit_config(decode_config(8, 128, 256, num_sms=132), torch.bfloat16, (9, 0)).zero_in_regs
