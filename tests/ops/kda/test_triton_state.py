"""The state kernels compile for Hopper (sm_90) on this CPU, with each feature on and all off.

The Triton interpreter (test_fla_chunk.py) runs a kernel's body as Python and so accepts code the compiler
refuses, e.g. a variable that changes type in one branch (the linked backward once reused `last`, an int64 row,
for an int32 CSR bound, and failed only on the GPU). `triton.compile` for a CUDA target needs no GPU: it runs
the front end, LLVM and the wheel's ptxas here.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from harts.ops.kda import triton_state  # noqa: E402

_POINTERS = {
    "forward": {"kg": "*bf16", "w": "*bf16", "u": "*bf16", "gk": "*fp32", "h": "*bf16", "v_new": "*bf16",
                "h0": "*fp32", "ht": "*fp32", "slot_states": "*fp32", "state_slot": "*i32", "cu_seqlens": "*i32",
                "chunk_offsets": "*i32", "ticket": "*i32", "flags": "*i32", "source_slot": "*i32"},
    "backward": {"qg": "*bf16", "kg": "*bf16", "w": "*bf16", "gk": "*fp32", "do": "*bf16", "dv": "*bf16",
                 "dv2": "*bf16", "dh": "*bf16", "dht": "*fp32", "dh0": "*fp32", "slot_grads": "*fp32",
                 "state_slot": "*i32", "cu_seqlens": "*i32", "chunk_offsets": "*i32", "scale": "fp32", "ticket": "*i32",
                 "flags": "*i32", "source_slot": "*i32", "consumer_ptr": "*i32", "consumers": "*i32",
                 "num_seqs": "i32"},
}
_SHAPE = {"H": 16, "K": 128, "V": 128, "BT": 64, "BK": 128, "BV": 64}
_FEATURES = {"forward": ("STORE_SLOTS", "LINKED"), "backward": ("USE_FINAL_GRADIENT", "INJECT", "LINKED", "AT_SLOTS")}


@pytest.mark.parametrize("features", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["all-on", "all-off"])
@pytest.mark.parametrize("kernel", ["forward", "backward"])
def test_state_kernels_compile_for_hopper(kernel, features, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled here, not read from an earlier run's cache
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    jit = getattr(triton_state, f"_state_{kernel}_kernel").fn  # the kernel under its autotuner
    constants = _SHAPE | dict.fromkeys(_FEATURES[kernel], features)
    assert set(_POINTERS[kernel]) | set(constants) == set(jit.arg_names), "the test's signature is the kernel's"
    signature = _POINTERS[kernel] | dict.fromkeys(constants, "constexpr")
    source = ASTSource(jit, signature, {(jit.arg_names.index(name),): value for name, value in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"]
