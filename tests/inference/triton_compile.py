"""Compile a Triton kernel for a Hopper GPU (sm_90) on any machine, CPU included.

The interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python, not Triton's compiler: code that the
compiler rejects (say, a variable bound to a pointer in one branch and to an integer in the other) can
pass every interpreter test and fail on the GPU. Triton's wheel carries ``ptxas``, so the full pipeline
(TTIR, TTGIR, LLVM IR, PTX, cubin) runs here without a GPU. It runs in a child process: a process whose
Triton started in interpreter mode cannot compile.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def compile_for_hopper(kernel: str, pointer_types: dict[str, str], constexprs: dict,
                       float_args: tuple[str, ...] = (), num_warps: int = 4, num_stages: int = 3) -> None:
    """Compile ``kernel`` (``"package.module:function"``, a ``@triton.jit`` function) for sm_90.

    Args:
        pointer_types: Triton pointer types by argument name (``"*bf16"``); other arguments are ``i32``
            unless named in ``float_args`` (``fp32``) or ``constexprs``.
    Raises:
        AssertionError: the compiler's error (what the GPU would raise at the first launch).
    """
    spec = dict(kernel=kernel, pointer_types=pointer_types, constexprs=constexprs, float_args=list(float_args),
                num_warps=num_warps, num_stages=num_stages)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.inference.triton_compile", json.dumps(spec)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{kernel} does not compile for sm_90:\n{done.stderr[-3000:]}"


def _compile(spec: dict) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = spec["kernel"].split(":")
    fn = getattr(importlib.import_module(module), name)
    consts = spec["constexprs"]
    signature = {arg: "constexpr" if arg in consts else spec["pointer_types"].get(arg)
                 or ("fp32" if arg in spec["float_args"] else "i32") for arg in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, signature, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]})
    assert compiled.asm["cubin"], "no cubin"


if __name__ == "__main__":
    _compile(json.loads(sys.argv[1]))
