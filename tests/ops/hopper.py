"""Compile Triton kernels for Hopper (sm_90) on the CPU, as the launches of the interpreter cases specialize them.

The Triton interpreter, which runs every kernel of harts on the CPU in the tests, executes a kernel's body as
Python, so it accepts code the compiler refuses (a variable whose type changes in a branch; the linked KDA backward
once failed only on a GPU). `triton.compile` for a CUDA target needs no GPU: the front end, LLVM and the wheel's
ptxas run here. `record_launches` (in the interpreter's subprocess) writes each launch of a harts kernel as one JSON
line: its argument types, constexpr values, the 16-byte divisibility the GPU launcher would see and the config's
warps, stages and fp fusion; `compile_launches` (in the test process) compiles each distinct one, once per test
session, through `compile_sm90`, which the tests of hand-written signatures call too.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os

HOPPER = 90
"""The compute capability the kernels are compiled for."""
LAUNCHES = "HARTS_TEST_LAUNCHES"
"""The environment variable naming the file the interpreter's subprocess appends its launches to."""

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "int64": "i64",
           "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


def _describe(fn, arg_names: list[str], args: tuple, kwargs: dict) -> dict:
    """A launch of the kernel `fn` (the Python function) as `compile_launches` reads it."""
    import torch

    values = dict(zip(arg_names, args)) | {name: kwargs[name] for name in arg_names if name in kwargs}
    params = inspect.signature(fn).parameters
    signature, constexprs, divisible = {}, {}, []
    for name in arg_names:
        value = values[name]
        annotation = params[name].annotation
        if "constexpr" in str(annotation) or value is None:
            assert value is None or isinstance(value, (bool, int, float, str)), f"{fn.__name__}.{name}: {value!r}"
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _DTYPES[str(value.dtype).removeprefix("torch.")]
            divisible += [name] if value.data_ptr() % 16 == 0 else []
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            divisible += [name] if value % 16 == 0 else []
        else:
            assert isinstance(value, float), f"{fn.__name__}.{name}: {type(value).__name__}"
            signature[name] = "fp32"
    options = {key: kwargs[key] for key in ("num_warps", "num_stages", "enable_fp_fusion")
               if kwargs.get(key) is not None}
    return {"kernel": f"{fn.__module__}:{fn.__name__}", "signature": signature, "constexprs": constexprs,
            "divisible": divisible, "options": options}


def record_launches(path: str) -> None:
    """In an interpreter process: append every launch of a harts kernel to `path` (JSON lines)."""
    import triton.runtime.interpreter as interpreter

    run = interpreter.InterpretedFunction.run

    def recorded(self, *args, grid, warmup, **kwargs):
        if not warmup and self.fn.__module__.startswith("harts."):
            with open(path, "a") as file:
                file.write(json.dumps(_describe(self.fn, self.arg_names, args, kwargs)) + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recorded


def jit_function(obj):
    """The JITFunction under a kernel's autotuner and heuristics."""
    import triton

    while not isinstance(obj, triton.runtime.jit.JITFunction):
        obj = obj.fn
    return obj


def compile_sm90(jit, signature: dict[str, str], constexprs: dict, divisible=(), options: dict | None = None):
    """The JITFunction `jit` compiled for sm_90 (Triton's CompiledKernel): `signature` every argument's type
    ("*bf16", "i32", "constexpr", ...), `constexprs` their values, `divisible` the arguments the launcher would
    specialize as 16-byte divisible, `options` warps, stages and fp fusion. Raises Triton's error where it refuses."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    index = {arg: (jit.arg_names.index(arg),) for arg in jit.arg_names}
    source = ASTSource(jit, signature, {index[arg]: value for arg, value in constexprs.items()},
                       {index[arg]: [["tt.divisibility", 16]] for arg in divisible})
    return triton.compile(source, target=GPUTarget("cuda", HOPPER, 32), options=options or {})


@functools.cache
def compile_for_hopper(launch: str) -> None:
    """Compile one launch (a JSON line of `record_launches`) for sm_90; raises Triton's error where it refuses."""
    launch = json.loads(launch)
    module, name = launch["kernel"].split(":")
    jit = jit_function(getattr(importlib.import_module(module), name))
    compiled = compile_sm90(jit, launch["signature"], launch["constexprs"], launch["divisible"], launch["options"])
    assert compiled.asm["cubin"]


def compile_launches(path: str) -> None:
    """Compile every distinct launch recorded in `path` for sm_90 (each once per process)."""
    if not os.path.exists(path):
        return
    with open(path) as file:
        launches = sorted(set(file.read().splitlines()))
    for launch in launches:
        try:
            compile_for_hopper(launch)
        except Exception as error:
            raise AssertionError(f"{json.loads(launch)['kernel']} does not compile for sm_90: {error}") from error
