"""When the installed fla refuses its GDN kernel's backward (fla 0.6 on Hopper with Triton >= 3.4.0 and < 3.7.1),
`check_gdn_kernel` refuses that kernel in one line before anything runs, naming fla's and Triton's versions, Hopper
and the knob value that works; nowhere else (another GPU, another Triton, tilelang taking the call, the KDA kernel,
the torch backend, the CPU). The condition is faked on this CPU: fla's own flags (fla.utils), or for an fla
without them the device capability and Triton's version."""

import pytest
import torch

from harts.ops.gdn import packed
from harts.ops.gdn.packed import check_gdn_kernel, fla_gdn_refusal

fla_utils = pytest.importorskip("fla.utils")


@pytest.fixture
def fake(monkeypatch):
    """fake(hopper, triton): fla's flags for a Hopper GPU or not and Triton's version (tilelang not taking the
    call unless `tilelang`)."""
    import triton

    def set_up(hopper: bool, version: str, *, tilelang: bool = False):
        monkeypatch.setattr(triton, "__version__", version)
        parsed = tuple(int(part) for part in version.split(".")[:3])
        monkeypatch.setattr(fla_utils, "IS_NVIDIA_HOPPER", hopper)
        monkeypatch.setattr(fla_utils, "TRITON_ABOVE_3_4_0", parsed >= (3, 4, 0))
        monkeypatch.setattr(fla_utils, "TRITON_ABOVE_3_7_1", parsed >= (3, 7, 1))
        monkeypatch.setattr(packed, "_fla_tilelang_takes_it", lambda: tilelang)

    return set_up


@pytest.mark.parametrize("hopper, version, tilelang, refused", [
    (True, "3.6.0", False, True),
    (True, "3.4.0", False, True),
    (True, "3.7.0", False, True),
    (True, "3.7.1", False, False),
    (True, "3.3.1", False, False),
    (False, "3.6.0", False, False),
    (True, "3.6.0", True, False),
], ids=["hopper-3.6", "hopper-3.4", "hopper-3.7.0", "hopper-3.7.1", "hopper-3.3", "ampere-3.6", "tilelang"])
def test_refused_exactly_where_fla_refuses(fake, hopper, version, tilelang, refused):
    fake(hopper, version, tilelang=tilelang)
    assert (fla_gdn_refusal() is not None) == refused
    if refused:
        with pytest.raises(ValueError):
            check_gdn_kernel("gdn", "fla", torch.device("cuda"))
    else:
        check_gdn_kernel("gdn", "fla", torch.device("cuda"))


def test_the_refusal_is_one_line_naming_the_versions_and_the_knob_value_that_works(fake):
    import fla

    fake(True, "3.6.0")
    with pytest.raises(ValueError) as error:
        check_gdn_kernel("gdn", "fla", "cuda", name="--gdn-kernel")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"--gdn-kernel gdn: fla {fla.__version__} refuses the backward of its GDN kernel")
    assert "on Hopper GPUs with Triton 3.6.0 (>= 3.4.0 and < 3.7.1" in message
    assert "; --gdn-kernel kda runs the baseline's GDN calls on fla's KDA kernels" in message


@pytest.mark.parametrize("kernel, backend, device", [("kda", "fla", "cuda"), ("gdn", "torch", "cuda"),
                                                     ("gdn", "fla", "cpu"), ("kda", "torch", "cpu")],
                         ids=["kda-kernel", "torch-backend", "cpu", "cpu-kda"])
def test_only_fla_gdn_kernel_on_cuda_is_ever_refused(fake, kernel, backend, device):
    fake(True, "3.6.0")
    check_gdn_kernel(kernel, backend, device)


@pytest.mark.parametrize("capability, name, version, refused", [
    ((9, 0), "NVIDIA H200", "3.6.0", True),
    ((9, 0), "NVIDIA H100 80GB HBM3", "3.5.1", True),
    ((9, 0), "NVIDIA H200", "3.7.1+git1234", False),
    ((9, 0), "NVIDIA H200", "3.3.1", False),
    ((8, 0), "NVIDIA A100-SXM4-80GB", "3.6.0", False),
    ((10, 0), "NVIDIA B200", "3.6.0", False),
], ids=["h200-3.6", "h100-3.5.1", "h200-3.7.1-dev", "h200-3.3", "a100", "b200"])
def test_without_flas_flags_the_same_condition_from_the_device(monkeypatch, capability, name, version, refused):
    """An fla without `TRITON_ABOVE_3_7_1` (older or newer): the condition from the capability (or the name) and
    Triton's version, as fla computes it."""
    import triton

    monkeypatch.delattr(fla_utils, "TRITON_ABOVE_3_7_1")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: name)
    monkeypatch.setattr(triton, "__version__", version)
    monkeypatch.setattr(packed, "_fla_tilelang_takes_it", lambda: False)
    reason = fla_gdn_refusal()
    assert (reason is not None) == refused
    if refused:
        assert f"Triton {version}" in reason and "Hopper" in reason


def test_tilelang_takes_the_call_where_fla_would_dispatch_it(monkeypatch):
    """fla's way out besides Triton >= 3.7.1: its tilelang backend, when available (tilelang and nvcc) and
    enabled, and fla's dispatch is on."""
    from fla.ops.common.backends.tilelang import CommonTileLangBackend

    monkeypatch.delenv("FLA_DISABLE_BACKEND_DISPATCH", raising=False)
    assert not packed._fla_tilelang_takes_it()  # no tilelang on this machine
    monkeypatch.setattr(CommonTileLangBackend, "is_available", classmethod(lambda cls: True))
    monkeypatch.setattr(CommonTileLangBackend, "is_enabled", lambda self: True)
    assert packed._fla_tilelang_takes_it()
    monkeypatch.setattr(CommonTileLangBackend, "is_enabled", lambda self: False)
    assert not packed._fla_tilelang_takes_it()
    monkeypatch.setattr(CommonTileLangBackend, "is_enabled", lambda self: True)
    monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "1")
    assert not packed._fla_tilelang_takes_it()
