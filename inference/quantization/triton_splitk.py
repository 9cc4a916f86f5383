"""The split-K epilogue shared by the Triton kernels that cut K across programs (the W4A16 decode and GEMV
kernels, the FP8 GEMM): partial sums to a float32 workspace, and the last program of an output tile to arrive
adds them in split order (deterministic), adds the bias and writes the output. The workspace and counters are
planned on the host by ``triton_w4a16_launch.plan_split_k``.

Source: the reduction by the last-arriving program is the "fixup" of stream-K (Osama et al., 2023,
arXiv:2301.03598) on a plain split-K grid.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _finish(acc, pid_k, tile, offs_m, offs_n, mask_m, mask_n, M, N, bias_ptr, partial_ptr, counter_ptr, out_ptr,
            SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    # Split-K epilogue: partial sums to the workspace; the last split of the tile to arrive adds them in
    # split order (deterministic), adds the bias, writes the output and resets the tile's counter.
    out_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    mask_out = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        tl.store(partial_ptr + pid_k.to(tl.int64) * M * N + out_offs, acc, mask=mask_out)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last split of this tile: reduce in split order
            acc = tl.zeros(acc.shape, dtype=tl.float32)
            for split in range(SPLIT_K):
                acc += tl.load(partial_ptr + split * M * N + out_offs, mask=mask_out, other=0.0,
                               cache_modifier=".cg")
            _store_output(acc, bias_ptr, out_ptr, out_offs, offs_n, mask_n, mask_out, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        _store_output(acc, bias_ptr, out_ptr, out_offs, offs_n, mask_n, mask_out, HAS_BIAS)


@triton.jit
def _store_output(acc, bias_ptr, out_ptr, out_offs, offs_n, mask_n, mask_out, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)
