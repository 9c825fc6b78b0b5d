"""Triton kernels under the interpreter. TRITON_INTERPRET must be set before any kernel module is
imported (triton.jit decides at decoration time), so this folder runs in its own pytest process:
`TRITON_INTERPRET=1 pytest tests/interpret` (the Makefile's `test` target does)."""
import os

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("tests/interpret needs TRITON_INTERPRET=1 set before pytest starts")

