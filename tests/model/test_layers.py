"""RMSNorm: the fused path (F.rms_norm, torch's fused kernel on CUDA) against the fp32 reference; the KDA layer's v
in training is its own tensor (what the KDA call keeps of the conv)."""

import pytest
import torch

from harts.model.layers import RMSNorm, rms_norm, rms_norm_reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _inputs(dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # Rows of different scales: a misplaced eps or a norm over the wrong dim shows on the small ones.
    scale = torch.logspace(-3, 2, 13)[:, None]
    x = (torch.randn(13, 96, generator=generator) * scale).to(device=device, dtype=dtype).requires_grad_()
    weight = (1 + 0.5 * torch.randn(96, generator=generator)).to(device=device, dtype=dtype).requires_grad_()
    return x, weight, torch.randn(13, 96, generator=generator).to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_rms_norm_equals_the_reference(dtype, device):
    x, weight, upstream = _inputs(dtype, device)
    outs, grads = [], []
    for fused in (True, False):
        out = rms_norm(x, weight, 1e-5, fused=fused)
        assert out.dtype == dtype
        grads.append(torch.autograd.grad(out, (x, weight), upstream))
        outs.append(out.detach())
    # Both compute in fp32 and round once: bf16 results within one rounding (2^-8 relative) of each other.
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (8e-3, 1e-5)
    torch.testing.assert_close(outs[0], outs[1], rtol=rtol, atol=atol)
    for fused_grad, reference_grad in zip(*grads):
        scale = reference_grad.float().abs().max()
        torch.testing.assert_close(fused_grad.float() / scale, reference_grad.float() / scale, rtol=0,
                                   atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_module_uses_the_reference_for_mixed_dtypes_on_cpu():
    norm = RMSNorm(96, 1e-5)
    x, _, _ = _inputs(torch.bfloat16, "cpu")
    torch.testing.assert_close(norm(x), rms_norm_reference(x, norm.weight, 1e-5), rtol=0, atol=0)


@pytest.mark.parametrize("execution", ["baseline", "compact"])
def test_kda_value_is_its_own_tensor_in_training(monkeypatch, execution):
    """The KDA call keeps v for its backward: v must not be a view of the conv's q/k/v buffer, or the kept
    v keeps q and k alive with it (8 KB a row per kept KDA layer in bf16). Without grad there is no copy."""
    import numpy as np

    from harts.model.config import load_model_config
    from harts.model.model import HybridModel
    from harts.objective.step import StepConfig, run_step
    from harts.runtime.layout import Layout
    from tests.objective.helpers import random_tree_step

    model = HybridModel(load_model_config("tiny"))
    model.init_weights(seed=0)
    step = random_tree_step(np.random.default_rng(0), num=4, max_len=30, vocab=3).step
    calls = []
    original = Layout.linear_attention

    def recording(self, q, k, v, g, beta):
        calls.append((torch.is_grad_enabled(), *(x.untyped_storage().data_ptr() for x in (q, k, v))))
        return original(self, q, k, v, g, beta)

    monkeypatch.setattr(Layout, "linear_attention", recording)
    for backward in (True, False):
        run_step(model, step, [np.arange(step.num_trajectories)], StepConfig(execution=execution), backward=backward)
    training = [call for call in calls if call[0]]
    inference = [call for call in calls if not call[0]]
    assert training and inference
    assert all(v != q and v != k for _, q, k, v in training), training
    assert all(q == k == v for _, q, k, v in inference), inference
