"""Set-up for running Triton kernels on the CPU in tests (``TRITON_INTERPRET=1``).

Import this module before ``triton``: without a CUDA device it turns the interpreter on and patches
three of its bugs.
"""
from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def fix_interpreter() -> None:
    """Work around four bugs of Triton 3.6's interpreter (CPU only; compiled kernels are unaffected).

    1. Loop bounds read from memory are 1-element arrays, which ``int()`` rejects from NumPy 2.4
       on (triton-lang/triton#9171, fixed upstream by #9172).
    2. ``tl.dot`` multiplies bfloat16 operands as their raw uint16 storage; convert them to float32.
    3. float32 -> bfloat16 casts truncate; the GPU (and PyTorch) round to nearest even.
    4. float32 -> float8e4nv casts round ties away from even and send some values just below a power of
       two to the wrong binade (-127.99 -> -64); the GPU (and PyTorch) round to nearest even.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_tessera_fixed", False):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    create_dot = interpreter.InterpreterBuilder.create_dot

    def to_f32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, to_f32(a), to_f32(b), d, input_precision, max_num_imprecise_acc)

    cast_impl, fp_to_fp = interpreter.InterpreterBuilder.cast_impl, interpreter.InterpreterBuilder.create_fp_to_fp

    def round_like_torch(src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            data = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            return interpreter.TensorHandle(data.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), tl.float8e4nv)
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return None
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # finite inputs only
        return interpreter.TensorHandle(rounded, tl.bfloat16)

    def patched_cast(self, src, dst_type):
        rounded = round_like_torch(src, dst_type)
        return cast_impl(self, src, dst_type) if rounded is None else rounded

    def patched_fp_to_fp(self, src, dst_type, rounding_mode):
        rounded = round_like_torch(src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode) if rounded is None else rounded

    interpreter._patch_lang_tensor = patched_tensor
    interpreter.InterpreterBuilder.create_dot = patched_dot
    interpreter.InterpreterBuilder.cast_impl = patched_cast
    interpreter.InterpreterBuilder.create_fp_to_fp = patched_fp_to_fp
    interpreter._tessera_fixed = True



if os.environ.get("TRITON_INTERPRET") == "1" and __import__("importlib").util.find_spec("triton"):
    fix_interpreter()
