"""GPU fast-math for the kernels' per-token arithmetic, where Triton's defaults spend instructions on
ranges the kernels never reach; under TRITON_INTERPRET (numpy, where libdevice does not exist) the
plain operations stand in, so interpreter tests check the kernels' logic and GPU tests these forms.

The drafting step is bound by instruction issue at large batches, so every instruction saved per
token shortens it (`python -m bench.step_sass` counts them).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

if os.environ.get("TRITON_INTERPRET") == "1":
    @triton.jit
    def fast_divide(x, y):
        return x / y

    @triton.jit
    def fast_exp(x):
        return tl.exp(x)
else:
    @triton.jit
    def fast_divide(x, y):
        """x / y to 2 ulps (the bound of Triton's `/`, div.full.f32) as one reciprocal and a
        multiply (div.approx.f32), without div.full's range scaling: for |y| in [2^-126, 2^126]."""
        return libdevice.fast_dividef(x, y)

    @triton.jit
    def fast_exp(x):
        """exp(x) as Triton's tl.exp computes it (ex2.approx of x log2(e)) but with results below
        2^-126 flushed to 0 (ex2.approx.ftz), without the rescaling that keeps them subnormal."""
        return libdevice.fast_expf(x)
