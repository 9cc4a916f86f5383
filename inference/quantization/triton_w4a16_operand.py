"""The Triton building blocks of the W4A16 decode kernels' K tiles (``triton_w4a16_decode``): a group's scales
and zero points, one K tile's packed words unpacked into a 16-bit MMA operand of exact ``code - zero`` integers (a
``lop3`` and a packed ``sub.bf16x2`` / ``sub.f16x2`` per pair of weights), and the x tile of a K tile. The layout they read is ``packing.pack_ktiled``'s; the exponent trick
that turns a code into a float without a conversion is described in ``triton_w4a16_decode``."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _group_params(scales_ptr, qzeros_ptr, group, offs_n, mask_n, N, EVEN_N: tl.constexpr):
    # scales_ptr: [G, N] float16 contiguous; qzeros_ptr: [G, N/8] int32, column n in bits 4(n%8).. of word n//8
    if EVEN_N:
        s = tl.load(scales_ptr + group * N + offs_n).to(tl.float32)
        zp = tl.load(qzeros_ptr + group * (N // 8) + offs_n // 8)
    else:
        s = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zp = tl.load(qzeros_ptr + group * (N // 8) + offs_n // 8, mask=mask_n, other=0)
    z = ((zp >> ((offs_n % 8) * 4)) & 0xF).to(tl.float32)
    return s, z * s, z


@triton.jit
def _sub_pairs(pairs, zero_pairs, BF16: tl.constexpr, ASM: tl.constexpr):
    # Two 16-bit floats OFFSET + code per int32 minus OFFSET + zero in both halves -> code - zero (exact), as
    # one packed subtraction. ASM: the PTX instruction (compiled kernels); else the same bits computed
    # element by element (Triton's interpreter, which runs no PTX).
    if ASM:
        out = tl.inline_asm_elementwise("sub.rn.bf16x2 $0, $1, $2;" if BF16 else "sub.rn.f16x2 $0, $1, $2;",
                                        "=r,r,r", [pairs, zero_pairs], dtype=tl.int32, is_pure=True, pack=1)
    else:
        dtype = tl.bfloat16 if BF16 else tl.float16
        lo = ((pairs & 0xF) - (zero_pairs & 0xF)).to(tl.float32).to(dtype).to(tl.int16, bitcast=True)
        hi = (((pairs >> 16) & 0xF) - (zero_pairs & 0xF)).to(tl.float32).to(dtype).to(tl.int16, bitcast=True)
        out = (lo.to(tl.int32) & 0xFFFF) | (hi.to(tl.int32) << 16)
    return out


@triton.jit
def _code_pairs(w, MAGIC: tl.constexpr):
    # (w & 0x000F000F) | OFFSET's bits in both halves: two 16-bit floats OFFSET + code, one lop3 (0xEA: a & b | c).
    if MAGIC == 0x4300:  # bfloat16 128.0
        out = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;", "=r,r", [w],
                                        dtype=tl.int32, is_pure=True, pack=1)
    else:                # float16 1024.0
        out = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x64006400, 0xEA;", "=r,r", [w],
                                        dtype=tl.int32, is_pure=True, pack=1)
    return out


@triton.jit
def _tile_operand(words, MAGIC: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr, zero=None,
                  BF16: tl.constexpr = False, ASM: tl.constexpr = False):
    # A K tile's words [BLOCK_N, 16] (word row 8h + p, see the kernel) -> the MMA's A operand [BLOCK_N, 128]:
    # OFFSET + code (float32: the code), its 128 input rows in natural order. Nibble j of word (h, p) holds
    # rows 16(4h + j) + 2p (low half) and + 1 (high half); joining the four nibbles and the two halves as new
    # trailing axes and moving them into place is a relabelling of registers, not a data movement.
    # With ``zero`` ([BLOCK_N] int32 zero points), the operand is code - zero instead (float32: as floats;
    # 16-bit: one packed subtraction per register, ``_sub_pairs``, before the halves are split).
    w = tl.reshape(words, (BLOCK_N, 2, 8))
    if ASM and not FP32:  # mask and OFFSET in one lop3 (ptxas does not merge an AND and an OR of two constants)
        pairs = tl.join(tl.join(_code_pairs(w, MAGIC), _code_pairs(w >> 4, MAGIC)),
                        tl.join(_code_pairs(w >> 8, MAGIC), _code_pairs(w >> 12, MAGIC)))
    else:
        pairs = tl.join(tl.join(w & 0x000F000F, (w >> 4) & 0x000F000F),
                        tl.join((w >> 8) & 0x000F000F, (w >> 12) & 0x000F000F))  # [BN, h, p, j0, j1]
        if not FP32:
            pairs = pairs | (MAGIC * 0x10001)
    if FP32:
        rows = tl.join(((pairs & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0,
                       ((pairs >> 16) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0)
        if zero is not None:
            rows = rows - zero.to(tl.float32)[:, None, None, None, None, None]
    else:
        if zero is not None:
            zero_pairs = tl.broadcast_to(((MAGIC + zero) * 0x10001)[:, None, None, None, None], pairs.shape)
            pairs = _sub_pairs(pairs, zero_pairs, BF16, ASM)
        rows = tl.join(pairs.to(tl.int16), (pairs >> 16).to(tl.int16))           # [BN, h, p, j0, j1, e]
    return tl.reshape(tl.permute(rows, (0, 1, 4, 3, 2, 5)), (BLOCK_N, 128))         # row 64h + 16j + 2p + e


@triton.jit
def _x_tile(x_ptr, perm_ptr, t, offs_kk, offs_m, mask_m, stride_xm, last, K, HAS_PERM: tl.constexpr,
            EVEN_K: tl.constexpr):
    # x^T tile [128, BLOCK_M]: input rows 128t .. 128t + 127; zeros past the split's last tile and K
    offs_k = t * 128 + offs_kk
    if HAS_PERM:
        cols = tl.load(perm_ptr + offs_k, mask=(offs_k < K) & (t < last), other=0)
    else:
        cols = offs_k
    if EVEN_K:
        mask = mask_m[None, :] & (t < last)
    else:
        mask = mask_m[None, :] & ((offs_k < K) & (t < last))[:, None]
    return tl.load(x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + cols[:, None], mask=mask, other=0.0)
