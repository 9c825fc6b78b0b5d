"""Triton kernels under the interpreter. TRITON_INTERPRET must be set before any kernel module is
imported (triton.jit decides at decoration time), so this folder runs in its own pytest process:
`TRITON_INTERPRET=1 pytest tests/interpret` (the Makefile's `test` target does)."""
import os

import triton.language as tl
from triton.runtime import interpreter

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("tests/interpret needs TRITON_INTERPRET=1 set before pytest starts")

_create_dot = interpreter.InterpreterBuilder.create_dot


def _create_dot_widening_bfloat16(self, a, b, d, input_precision, max_num_imprecise_acc):
    """Triton 3.6's interpreter keeps bfloat16 tensors as their uint16 bits, and tl.dot multiplies
    those bits; widen them to float32 first, the values the GPU's bfloat16 dot multiplies."""
    a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
    return _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


interpreter.InterpreterBuilder.create_dot = _create_dot_widening_bfloat16
