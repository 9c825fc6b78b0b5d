"""Ahead-of-time compilation of the ops' Triton kernels for a GPU target on any machine (no GPU or
driver needed): what a launch on a Hopper GPU (sm_90) compiles. The CPU tests compile the launches the
ops' own launchers make (LaunchRecorder, with meta tensors), which catches what the Triton
interpreter does not check (the compiled language's typing, layouts, resources);
bench/step_sass.py reads the machine code."""
from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)  # Hopper, the GPU the kernels are tuned for
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64",
                 torch.int32: "*i32"}


def compile_kernel(kernel, types: dict[str, str], constexprs: dict, num_warps: int, aligned: tuple[str, ...] = (),
                   launch_pdl: bool = False):
    """The compiled `kernel` (a @triton.jit function) for sm_90. types: Triton types of the
    pointer and scalar arguments ("*bf16", "i64", ...; int32 where missing); constexprs: the
    compile-time arguments. Pointers and the `aligned` arguments are specialized as multiples of 16,
    as a launch at the ops' shapes (V = 200064 and its strides) specializes them. launch_pdl: for a
    programmatic dependent launch."""
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("_ptr") or n in aligned}
    return triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs), target=SM90,
                          options={"num_warps": num_warps, "launch_pdl": launch_pdl})


def scalar_or_pointer_type(arg) -> str:
    """The Triton type a launch gives `arg`: a tensor's pointer type, fp32 for a float, i32 or i64."""
    if isinstance(arg, torch.Tensor):
        return POINTER_TYPES[arg.dtype]
    if isinstance(arg, float):
        return "fp32"
    return "i32" if -2**31 <= arg < 2**31 else "i64"


class LaunchRecorder:
    """A `wrap` for the ops' launchers (`launch_step(wrap, ...)`): `wrap(kernel)[grid](*args, **kw)`
    records the launch instead of running it; `compile_all()` compiles every recorded launch for the
    sm_90, its argument types taken from the tensors (meta tensors do) and scalars given."""

    def __init__(self):
        self.launches = []

    def __call__(self, kernel):
        recorder = self

        class Grid:
            def __getitem__(self, grid):
                def launch(*args, num_warps=4, launch_pdl=False, **constexprs):
                    recorder.launches.append((kernel, args, constexprs, num_warps, launch_pdl))
                return launch
        return Grid()

    def compile_all(self) -> list:
        compiled = []
        for kernel, args, constexprs, num_warps, launch_pdl in self.launches:
            names = [n for n in kernel.arg_names if n not in constexprs]
            types = {n: scalar_or_pointer_type(a) for n, a in zip(names, args)}
            aligned = tuple(n for n, a in zip(names, args) if not isinstance(a, torch.Tensor) and a % 16 == 0)
            compiled.append(compile_kernel(kernel, types, constexprs, num_warps, aligned, launch_pdl=launch_pdl))
        return compiled
