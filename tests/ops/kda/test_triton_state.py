"""The state kernels compile for Hopper (sm_90) on this CPU with every feature on (tests/ops/hopper.py).

Every interpreter case compiles the launches it made (`run_interpreted`), all features off among them; none
launches the backward with the slot gradients injected, linked and a final-state gradient at once.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from harts.ops.kda import triton_state  # noqa: E402
from tests.ops import hopper  # noqa: E402

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


@pytest.mark.parametrize("kernel", ["forward", "backward"])
def test_state_kernels_compile_for_hopper_with_every_feature(kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled here, not read from an earlier run's cache
    jit = hopper.jit_function(getattr(triton_state, f"_state_{kernel}_kernel"))
    constants = _SHAPE | dict.fromkeys(_FEATURES[kernel], True)
    assert set(_POINTERS[kernel]) | set(constants) == set(jit.arg_names), "the test's signature is the kernel's"
    pointers = [arg for arg, kind in _POINTERS[kernel].items() if kind.startswith("*")]
    compiled = hopper.compile_sm90(jit, _POINTERS[kernel] | dict.fromkeys(constants, "constexpr"), constants,
                                   divisible=pointers, options={"num_warps": 4})
    assert compiled.asm["cubin"]
