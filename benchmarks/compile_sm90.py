"""Compile the quantization kernels for an H100/H200 (sm_90) on a machine without a GPU, and print what
ptxas reports (registers a thread, spills, shared memory) and the SASS instructions in each kernel's
main loop: the offline check that a kernel compiles, and a proxy for its cost (a 128-column K tile of
the W4A16 decode kernels holds 16,384 weights; HBM delivers about 16 bytes a clock per SM, so the loop
must issue at most ~4 instructions a weight per thread to keep up).

    python benchmarks/compile_sm90.py

Needs Triton's bundled ptxas and cuobjdump (shipped in the triton wheel); no CUDA device.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be real JIT functions, not interpreted ones
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from inference.quantization.triton_fp8 import _per_token_fp8_kernel  # noqa: E402
from inference.quantization.triton_w4a16 import _w4a16_kernel  # noqa: E402
from inference.quantization.triton_w4a16_decode import _w4a16_decode_kernel, _w4a16_decode_tile_kernel  # noqa: E402
from inference.quantization.triton_w4a16_gemv import _w4a16_gemv_kernel  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
POINTERS = {"x_ptr": "*bf16", "qweight_ptr": "*i32", "scales_ptr": "*fp16", "qzeros_ptr": "*i32", "perm_ptr": "*i64",
            "bias_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32", "out_ptr": "*bf16",
            "row_groups_ptr": "*i32"}


def _signature(fn, constexprs: dict, overrides: dict | None = None) -> dict:
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in constexprs else (overrides or {}).get(name, POINTERS.get(name, "i32"))
    return sig


def _main_loop(sass: str) -> collections.Counter:
    """Opcodes between the target and the source of the longest backward branch."""
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = collections.Counter()
    for address, text in code:
        target = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            body = [t for a, t in code if int(target.group(1), 16) <= a <= address]
            if len(body) > sum(best.values()):
                best = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    return best


def report(name: str, fn, constexprs: dict, num_warps: int, num_stages: int, overrides: dict | None = None,
           weights_per_thread: int | None = None) -> None:
    # As the JIT specializes a launch on the 7B shapes: pointers and N, K, row strides divisible by 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name not in constexprs and (name.endswith("_ptr") or name in ("N", "K", "stride_xm"))}
    kernel = triton.compile(ASTSource(fn=fn, signature=_signature(fn, constexprs, overrides), constexprs=constexprs,
                                      attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(kernel.asm["ptx"])
        ptxas = subprocess.run([BIN / "ptxas", "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True, text=True)
        sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    regs = re.search(r"Used (\d+) registers", ptxas.stderr)
    spills = re.search(r"(\d+) bytes spill stores", ptxas.stderr)
    loop = _main_loop(sass)
    total = sum(loop.values())
    per_weight = f", {total / weights_per_thread:.1f} a weight" if weights_per_thread else ""
    print(f"{name}: {regs.group(1) if regs else '?'} registers, {spills.group(1) if spills else '?'} B spilled, "
          f"{kernel.metadata.shared} B shared; main loop {total} instructions{per_weight}: "
          + " ".join(f"{op} {n}" for op, n in loop.most_common(8)), flush=True)


def main() -> None:
    for block_m, block_n, warps in ((16, 128, 4), (16, 256, 8), (16, 64, 4), (32, 128, 4), (64, 128, 4), (64, 128, 8)):
        common = dict(GROUP_SIZE=128, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=4, HAS_PERM=False, HAS_BIAS=True,
                      MAGIC=0x4300, OFFSET=128.0, EVEN_K=True, EVEN_N=True)
        report(f"decode BM{block_m} BN{block_n} w{warps}", _w4a16_decode_kernel, dict(common, CHUNKS_PER_GROUP=8),
               warps, 4, weights_per_thread=16 * block_n * 8 // (32 * warps))
        for label, zero_in_regs, x_sums, x_in_loop in (("", False, False, False), (" x-sums", False, True, False),
                                                       (" zero-in-regs", True, False, False),
                                                       (" x-sums x-in-loop", False, True, True),
                                                       (" zero-in-regs x-in-loop", True, False, True)):
            report(f"decode tile{label} BM{block_m} BN{block_n} w{warps}", _w4a16_decode_tile_kernel,
                   dict(common, ZERO_IN_REGS=zero_in_regs, X_SUMS=x_sums, ASM=True, PREFETCH=True,
                        X_IN_LOOP=x_in_loop), warps, 4,
                   weights_per_thread=16 * block_n * 8 // (32 * warps))
    for block_m, block_n, warps in ((1, 128, 4), (1, 64, 4), (1, 256, 8), (2, 128, 4), (4, 64, 4)):
        for prefetch in (True, False):
            report(f"gemv{' prefetch' if prefetch else ''} BM{block_m} BN{block_n} w{warps}", _w4a16_gemv_kernel,
                   dict(GROUP_SIZE=128, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=4, HAS_PERM=False, HAS_BIAS=True,
                        EVEN_N=True, ASM=True, PREFETCH=prefetch, X_PAIRS=True), warps, 1,
                   weights_per_thread=16 * block_n * 8 // (32 * warps))
    report("gemm BM64 BN128 (prefill)", _w4a16_kernel, dict(GROUP_SIZE=128, BLOCK_M=64, BLOCK_N=128,
                                                            DOT_PRECISION="tf32", ROW_GROUPS=False), 4, 3,
           {"out_ptr": "*fp32"})
    report("per-token fp8", _per_token_fp8_kernel, dict(BLOCK=2048, FP8_MAX=448.0, MIN_SCALE=1e-12), 8, 3,
           {"codes_ptr": "*fp8e4nv", "scales_ptr": "*fp32"})


if __name__ == "__main__":
    main()
