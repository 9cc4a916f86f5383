"""Compile Triton kernels for a Hopper GPU (sm_90) on any machine, CPU included.

The interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python, not Triton's compiler: code that the
compiler rejects (say, a variable bound to a pointer in one branch and to an integer in the other) can
pass every interpreter test and fail on the GPU at its first launch. Triton's wheel carries ``ptxas``,
so the whole pipeline (TTIR, TTGIR, LLVM IR, PTX, cubin) runs here without a GPU.

:func:`record_launches` notes the kernels that interpreted calls launch, with their arguments'
types; :func:`compile_for_hopper` compiles them, specialised as Triton's launcher would specialise them
on the GPU (integers equal to 1 and multiples of 16, 16-byte-aligned pointers), in a child process: a
process whose Triton started in interpreter mode cannot compile.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
                 torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
                 torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _describe(value, constexpr: bool) -> dict:
    """What Triton's launcher specialises a kernel on: a constexpr's value, a pointer's element type and
    16-byte alignment, an integer's width and whether it is 1 or a multiple of 16."""
    if type(value).__name__ == "dtype" and hasattr(value, "primitive_bitwidth"):  # a tl.dtype constexpr
        return {"tl_dtype": value.name}
    if constexpr or value is None or isinstance(value, str):
        return {"const": value}
    if isinstance(value, torch.Tensor):
        return {"pointer": _TRITON_TYPES[value.dtype], "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, bool):
        return {"bool": True}
    if isinstance(value, int):
        return {"int": "one" if value == 1 else "div16" if value % 16 == 0
                else "i32" if -2**31 <= value < 2**31 else "i64"}
    if isinstance(value, float):
        return {"float": True}
    raise TypeError(f"cannot describe a kernel argument of type {type(value).__name__}")


@contextlib.contextmanager
def record_launches():
    """Within the block, every kernel launch through the interpreter is appended to the yielded list as
    ``{"kernel": "module:function", "args": {name: description}, "options": {...}}`` (and still runs)."""
    from triton.runtime.interpreter import InterpretedFunction
    launches: list[dict] = []
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        signature = inspect.signature(self.fn)
        params = signature.parameters
        binding = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in params})
        binding.apply_defaults()  # a parameter left at its default compiles with that default
        bound = dict(binding.arguments)
        launches.append({"kernel": f"{self.fn.__module__}:{self.fn.__name__}",
                         "args": {k: _describe(v, "constexpr" in str(params[k].annotation)) for k, v in bound.items()},
                         "options": {k: v for k, v in kwargs.items() if k in _OPTIONS}})
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        yield launches
    finally:
        InterpretedFunction.run = run


def compile_for_hopper(launches: list[dict], arch: int = 90) -> None:
    """Compile each recorded launch (duplicates once) for sm_90, or for ``arch`` (80: an A100).

    Raises:
        AssertionError: with the compiler's error for the first kernel that does not compile.
    """
    launches = [dict(launch, arch=arch) for launch in launches]
    unique = list({json.dumps(launch, sort_keys=True): launch for launch in launches}.values())
    if not unique:
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.inference.triton_compile"], input=json.dumps(unique),
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"a kernel does not compile for sm_{arch}:\n{done.stderr[-4000:]}"


def _compile(launch: dict) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = launch["kernel"].split(":")
    fn = getattr(importlib.import_module(module), name)
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(fn.params):
        arg = launch["args"].get(param.name, {"const": None})
        if "const" in arg or "tl_dtype" in arg:
            signature[param.name] = "constexpr"
            constexprs[param.name] = triton.language.dtype(arg["tl_dtype"]) if "tl_dtype" in arg else arg["const"]
        elif "pointer" in arg:
            signature[param.name] = "*" + arg["pointer"]
            if arg["aligned"] and not param.do_not_specialize_on_alignment:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif "float" in arg:
            signature[param.name] = "fp32"
        elif "bool" in arg:
            signature[param.name] = "i1"
        elif arg["int"] == "one" and not param.do_not_specialize:  # the launcher makes an integer 1 a constant
            signature[param.name], constexprs[param.name] = "constexpr", 1
        else:
            signature[param.name] = "i64" if arg["int"] == "i64" else "i32"
            if arg["int"] == "div16" and not param.do_not_specialize:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    try:
        triton.compile(source, target=GPUTarget("cuda", launch.get("arch", 90), 32), options=launch["options"])
    except Exception as exc:
        raise SystemExit(f"{launch['kernel']} with {constexprs} {launch['options']}:\n{exc}") from exc


if __name__ == "__main__":
    from concurrent.futures import ProcessPoolExecutor
    specs = json.loads(sys.stdin.read())
    with ProcessPoolExecutor(max_workers=min(len(specs), os.cpu_count() or 1)) as pool:
        list(pool.map(_compile, specs))
