"""4-bit weight layouts of AWQ and GPTQ checkpoints, and the PyTorch dequantization reference.

Unpacked form used throughout (all integer tensors int32):

* ``q [K, N]``: the 4-bit codes 0..15 of a linear layer with ``K`` input and ``N`` output features
  (the transpose of ``nn.Linear.weight``), ``w[k, n] = (q[k, n] - zeros[g[k], n]) * scales[g[k], n]``;
* ``scales [G, N]`` float, ``zeros [G, N]`` int codes 0..15, ``g_idx [K]`` the group of each input row
  (``k // group_size`` unless GPTQ act-order scattered them).

On-disk layouts (each int32 holds eight 4-bit codes, code ``i`` in bits ``4i..4i+3``):

* AWQ GEMM (Lin et al., 2023; llm-awq / AutoAWQ ``WQLinear_GEMM``): ``qweight [K, N/8]``,
  ``qzeros [G, N/8]``, ``scales [G, N]`` float16. Along N, int32 column ``c`` holds the columns
  ``8c + AWQ_ORDER[i]`` in code slots ``i = 0..7`` (the interleaving of AWQ's GEMM kernel).
* GPTQ v1 (Frantar et al., 2022; AutoGPTQ / GPTQModel ``format="gptq"``): ``qweight [K/8, N]``
  packed sequentially along K (row ``r`` holds input rows ``8r..8r+7``), ``qzeros [G, N/8]``
  packed sequentially along N and storing ``zero - 1`` (the v1 convention that GPTQModel's
  "v2" format undoes), ``scales [G, N]`` float16, ``g_idx [K]`` int32.

Tessera's kernels read one internal layout, "K-tiled": ``qzeros [G, N/8]`` packed sequentially along N
with true zero points (not minus one), ``scales [G, N]`` float16, rows sorted by group, and
``qweight [K_pad/8, N]`` int32 with ``K_pad = K`` rounded up to a multiple of ``PACK_K = 128``. Tile ``t``'s
16 word rows hold its 128 input rows so that 16-row chunk ``i = 4h + j`` (rows ``128t + 16i + r``) sits in
word rows ``16t + 8h + p`` (``p = 0..7``), row ``2p`` in bits ``4j..4j+3`` and row ``2p + 1`` in bits
``16+4j..16+4j+3``: one shift and one mask give a pair of consecutive rows as the two 16-bit halves of a
register, which is how an MMA's A operand holds them (the layout idea of Marlin, Frantar et al., 2024,
arXiv:2408.11743), so the decode kernel unpacks a chunk without moving nibbles between registers
(``pack_ktiled``).
"""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # code slot i of an AWQ int32 holds column 8c + AWQ_ORDER[i]
PACK_K = 128                          # input rows per tile of the internal K-tiled qweight


def counters_size(out_features: int) -> int:
    """Split-K arrival counters (int32) a layer of ``out_features`` needs for every config of the W4A16
    decode kernel (``triton_w4a16_decode.decode_config``) and the benchmark sweep: tiles of at least 32
    columns, at most 2 row blocks."""
    return 2 * -(-out_features // 32)


def _shifts(device) -> torch.Tensor:
    # Made per call on an explicit device: this module may first be imported under torch.device("meta").
    return torch.arange(0, 32, 4, dtype=torch.int64, device=device)


def _to_int32(packed64: torch.Tensor) -> torch.Tensor:
    return torch.where(packed64 >= 2 ** 31, packed64 - 2 ** 32, packed64).to(torch.int32)


def _pack_last(codes: torch.Tensor) -> torch.Tensor:
    """``[..., 8m]`` codes -> ``[..., m]`` int32, code ``i`` of each group of eight in bits 4i..4i+3."""
    grouped = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, 8)
    return _to_int32((grouped << _shifts(codes.device)).sum(-1))


def _unpack_last(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_pack_last``: ``[..., m]`` int32 -> ``[..., 8m]`` int32 codes."""
    wide = packed.to(torch.int64) & 0xFFFFFFFF
    codes = (wide.unsqueeze(-1) >> _shifts(packed.device)) & 0xF
    return codes.reshape(*packed.shape[:-1], -1).to(torch.int32)


def _check_codes(codes: torch.Tensor, name: str) -> None:
    if codes.shape[-1] % 8:
        raise ValueError(f"{name}: the packed dimension ({codes.shape[-1]}) must be a multiple of 8")


# ---- AWQ GEMM ----
def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` codes -> ``[R, N/8]`` int32 in AWQ's interleaved column order (qweight and qzeros)."""
    _check_codes(codes, "AWQ packing")
    order = torch.tensor(AWQ_ORDER, device=codes.device)
    interleaved = codes.reshape(codes.shape[0], -1, 8)[:, :, order].reshape(codes.shape)
    return _pack_last(interleaved)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """``[R, N/8]`` AWQ int32 -> ``[R, N]`` int32 codes in natural column order."""
    slots = _unpack_last(packed).reshape(packed.shape[0], -1, 8)
    inverse = torch.argsort(torch.tensor(AWQ_ORDER, device=packed.device))
    return slots[:, :, inverse].reshape(packed.shape[0], -1)


# ---- GPTQ v1 ----
def pack_gptq_qweight(codes: torch.Tensor) -> torch.Tensor:
    """``[K, N]`` codes -> ``[K/8, N]`` int32 packed along K (GPTQ qweight, also the internal layout)."""
    _check_codes(codes.t(), "GPTQ qweight packing (K)")
    return _pack_last(codes.t().contiguous()).t().contiguous()


def unpack_gptq_qweight(packed: torch.Tensor) -> torch.Tensor:
    """``[K/8, N]`` int32 -> ``[K, N]`` int32 codes."""
    return _unpack_last(packed.t().contiguous()).t().contiguous()


# ---- internal K-tiled layout ----
def pack_ktiled(codes: torch.Tensor) -> torch.Tensor:
    """``[K, N]`` codes -> internal ``qweight [K_pad/8, N]`` int32 (K padded to a multiple of ``PACK_K``
    with code 0). In tile ``t``, word row ``16t + 8h + p`` holds, for ``j = 0..3``, input row
    ``128t + 16(4h + j) + 2p`` in bits ``4j..4j+3`` and the next row in bits ``16+4j..16+4j+3``."""
    K, N = codes.shape
    k_pad = -(-K // PACK_K) * PACK_K
    padded = torch.zeros((k_pad, N), dtype=torch.int32, device=codes.device)
    padded[:K] = codes
    # local row 64h + 16j + 2p + e -> word (h, p), code slot 4e + j
    tiled = padded.view(k_pad // PACK_K, 2, 4, 8, 2, N).permute(0, 1, 3, 5, 4, 2).reshape(k_pad // PACK_K, 2, 8, N, 8)
    return _pack_last(tiled).reshape(k_pad // 8, N)


def unpack_ktiled(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """Inverse of ``pack_ktiled``: internal ``qweight [K_pad/8, N]`` -> ``[in_features, N]`` int32 codes."""
    rows, N = packed.shape
    slots = _unpack_last(packed.reshape(rows // 16, 16, N))              # [tiles, (h, p), (n, e, j)]
    codes = slots.view(rows // 16, 2, 8, N, 2, 4).permute(0, 1, 5, 2, 4, 3)   # [tiles, h, j, p, e, N]
    return codes.reshape(rows * 8, N)[:in_features].contiguous()


def pack_cols(codes: torch.Tensor) -> torch.Tensor:
    """``[G, N]`` codes -> ``[G, N/8]`` int32 packed sequentially along N (GPTQ qzeros, internal qzeros)."""
    _check_codes(codes, "zero-point packing")
    return _pack_last(codes)


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """``[G, N/8]`` int32 -> ``[G, N]`` int32 codes."""
    return _unpack_last(packed)


def group_index(in_features: int, group_size: int, device=None) -> torch.Tensor:
    """``g_idx [K]`` int32 without act-order: ``k // group_size`` (one group for ``group_size == -1``)."""
    size = in_features if group_size == -1 else group_size
    return torch.arange(in_features, dtype=torch.int32, device=device) // size


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference dequantization: ``[K, N]`` codes -> ``[K, N]`` weights in ``dtype``, computed in float32.

    ``w[k, n] = (codes[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]``.
    """
    g = g_idx.long()
    return ((codes.float() - zeros[g].float()) * scales[g].float()).to(dtype)


def quantize_codes(w_t: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """Round ``w_t [K, N]`` (float) to codes with given ``scales``/``zeros [G, N]``: ``clamp(round(w/s) + z, 0, 15)``."""
    g = g_idx.long()
    return torch.clamp(torch.round(w_t.float() / scales[g].float()) + zeros[g].float(), 0, 15).to(torch.int32)


def minmax_params(w_group: torch.Tensor, sym: bool, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit scale and zero of each slice of ``w_group`` reduced over ``dim`` (``[rows, N]`` -> ``[N]``
    by default): asymmetric min-max including 0, or symmetric around zero point 8.

    Returns ``(scales float32 holding float16 values, zeros int32)``; all-zero slices get scale 1.
    """
    w = w_group.float()
    wmin = torch.clamp(w.amin(dim), max=0)
    wmax = torch.clamp(w.amax(dim), min=0)
    if sym:
        wmax = torch.maximum(wmin.abs(), wmax)
        scales = torch.where(wmax > 0, 2 * wmax / 15, torch.ones_like(wmax))
        zeros = torch.full_like(wmax, 8, dtype=torch.int32)
    else:
        scales = torch.where(wmax > wmin, (wmax - wmin) / 15, torch.ones_like(wmax))
        zeros = torch.clamp(torch.round(-wmin / scales), 0, 15).to(torch.int32)
    scales = scales.to(torch.float16).float()  # as stored on disk, so codes and checkpoint agree
    return scales, zeros


def dequantize_internal(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """Dequantize the internal layout (K-tiled ``qweight [K_pad/8, N]``, ``qzeros [G, N/8]``, ``scales [G, N]``,
    rows sorted by group; ``K = G * group_size``) to ``[K, N]`` in ``dtype``, computed in float32: the CPU
    path and the kernels' oracle."""
    G, N = scales.shape
    K = G * group_size
    codes = unpack_ktiled(qweight, K).view(G, group_size, N)
    zeros = unpack_cols(qzeros).view(G, 1, N)
    return ((codes.float() - zeros.float()) * scales.float()[:, None, :]).view(K, N).to(dtype)
