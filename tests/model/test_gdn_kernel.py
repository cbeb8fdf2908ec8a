"""The baseline's GDN kernel (`StepConfig.gdn_kernel`) from the step config to every packed GDN call of a
gdn-tiny step, and the model's check of it before its first block runs (`HybridModel.run_blocks`): fla refuses its
GDN kernel only in the backward, after the whole forward ran. On the CPU the refusal is stood in for by a check
that refuses the "gdn" kernel whatever the device (harts.ops.gdn.packed.check_gdn_kernel, tested on its own in
tests/ops/gdn/test_refusal.py)."""

import numpy as np
import pytest

from harts.config.execution import GDN_KERNELS
from harts.model import model as model_module
from harts.model.config import load_model_config
from harts.model.model import HybridModel
from harts.objective.step import StepConfig, run_step
from harts.ops.gdn import packed
from tests.fixtures import packed_gdn_kernels  # noqa: F401
from tests.model.test_fork_failure_modes import rl_step, tree_sequences


@pytest.fixture(scope="module")
def step():
    rng = np.random.default_rng(3)
    return rl_step(tree_sequences(rng, [-1, 0, 0, 1], [20, 7, 1, 5]), rng)


def _model(name: str) -> HybridModel:
    model = HybridModel(load_model_config(name))
    model.init_weights(seed=0)
    return model


def _blocks_run(monkeypatch) -> list[int]:
    """Counts the blocks that run (any kind)."""
    runs = []
    forward = model_module.Block.forward

    def counted(self, *args, **kwargs):
        runs.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(model_module.Block, "forward", counted)
    return runs


@pytest.mark.parametrize("kernel", GDN_KERNELS)
def test_the_knob_reaches_every_packed_gdn_call_of_the_baseline(step, packed_gdn_kernels, kernel):
    kernels = packed_gdn_kernels
    model = _model("gdn-tiny")
    members = np.arange(step.num_trajectories)
    run_step(model, step, [members], StepConfig(execution="baseline", gdn_kernel=kernel))
    assert kernels == [kernel] * model.config.layer_kinds().count("gdn")
    kernels.clear()
    run_step(model, step, [members], StepConfig(execution="compact", gdn_kernel=kernel))
    assert kernels == []  # the compact calls run the KDA machinery, never the packed call


def _refusing_gdn(monkeypatch) -> list[tuple]:
    """check_gdn_kernel refusing kernel "gdn" on any device and backend (fla's refusal, stood in for on the CPU);
    the calls it got."""
    calls = []

    def check(kernel, backend, device, *, name="gdn_kernel"):
        calls.append((kernel, backend, str(device)))
        if kernel == "gdn":
            raise ValueError(f"{name} gdn: refused")

    monkeypatch.setattr(packed, "check_gdn_kernel", check)
    return calls


def test_the_model_checks_the_baselines_kernel_before_its_first_block(step, monkeypatch):
    calls = _refusing_gdn(monkeypatch)
    runs = _blocks_run(monkeypatch)
    model = _model("gdn-tiny")
    members = np.arange(step.num_trajectories)
    with pytest.raises(ValueError, match="^gdn_kernel gdn: refused$"):
        run_step(model, step, [members], StepConfig(execution="baseline", recompute=True))
    assert calls == [("gdn", "torch", "cpu")] and runs == []
    run_step(model, step, [members], StepConfig(execution="baseline", gdn_kernel="kda"))
    assert calls[-1] == ("kda", "torch", "cpu") and runs


@pytest.mark.parametrize("model_name, execution", [("gdn-tiny", "compact"), ("tiny", "baseline")],
                         ids=["gdn-compact", "kda-model-baseline"])
def test_no_check_where_no_packed_gdn_call_runs(step, monkeypatch, model_name, execution):
    calls = _refusing_gdn(monkeypatch)
    members = np.arange(step.num_trajectories)
    run_step(_model(model_name), step, [members], StepConfig(execution=execution))
    assert calls == []
