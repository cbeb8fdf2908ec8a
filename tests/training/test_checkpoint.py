import json
import random

import numpy as np
import pytest
import torch
from torch import nn

from harts.training import checkpoint as checkpoint_module
from harts.training.checkpoint import (
    latest_checkpoint, load_checkpoint, read_metadata, remove_stale, save_checkpoint,
)
from harts.training.config import OptimizerConfig, ScheduleConfig
from harts.training.optim import MasterWeightAdamW, make_scheduler


class _Tied(nn.Module):
    """A plain model with a tied weight and a buffer, like HybridModel's embeddings and expert bias."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = nn.Embedding(9, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 9, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("bias_E", torch.zeros(3))
        self.to(dtype)

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


def _trained(seed: int, dtype: torch.dtype, steps: int = 2):
    torch.manual_seed(seed)
    model = _Tied(dtype)
    optimizer = MasterWeightAdamW(model.named_parameters(), OptimizerConfig(lr=0.01))
    scheduler = make_scheduler(optimizer, ScheduleConfig(warmup_steps=3), num_steps=5)
    for step in range(steps):
        optimizer.zero_grad()
        model(torch.arange(9) % (step + 2)).float().square().sum().backward()
        optimizer.step()
        scheduler.step()
        model.bias_E += 0.5
    return model, optimizer, scheduler


def _save(run_dir, step, model, optimizer, scheduler, order=(2, 0, 1)):
    return save_checkpoint(run_dir, step, model=model, optimizer=optimizer, scheduler=scheduler,
                           trainer={"epoch_order": list(order), "torch_threads": 1}, config={"train": {"a": 1}},
                           cuda=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-masters"])
def test_round_trip_restores_everything(tmp_path, dtype):
    model, optimizer, scheduler = _trained(0, dtype)
    path = _save(tmp_path, 2, model, optimizer, scheduler)
    assert path == tmp_path / "checkpoints" / "step_000002"
    assert (path / "master.safetensors").exists() == (dtype == torch.bfloat16)
    restored, restored_optimizer, restored_scheduler = _trained(1, dtype, steps=0)
    trainer = load_checkpoint(path, model=restored, optimizer=restored_optimizer, scheduler=restored_scheduler)
    assert trainer == {"format_version": 1, "step": 2, "epoch_order": [2, 0, 1], "torch_threads": 1}
    assert read_metadata(path)[1] == {"train": {"a": 1}}
    for (name, a), b in zip(model.state_dict().items(), restored.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for a, b in zip(optimizer.masters, restored_optimizer.masters):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    assert restored.head.weight is restored.embed.weight
    assert restored_scheduler.state_dict() == scheduler.state_dict()
    # One more identical step from both: the optimizer's moments and step counts came back.
    for m, o, s in ((model, optimizer, scheduler), (restored, restored_optimizer, restored_scheduler)):
        o.zero_grad()
        m(torch.arange(9) % 4).float().square().sum().backward()
        o.step()
        s.step()
    for a, b in zip(model.parameters(), restored.parameters()):
        assert torch.equal(a, b)


def test_rng_states_are_restored(tmp_path):
    model, optimizer, scheduler = _trained(0, torch.float32)
    torch.manual_seed(11)
    np.random.seed(12)
    random.seed(13)
    path = _save(tmp_path, 1, model, optimizer, scheduler)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]


def test_a_failed_save_leaves_no_checkpoint(tmp_path, monkeypatch):
    model, optimizer, scheduler = _trained(0, torch.float32)
    _save(tmp_path, 2, model, optimizer, scheduler)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module, "_write_json", crash)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 4, model, optimizer, scheduler)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000002"
    (stale,) = remove_stale(tmp_path)
    assert stale.name.startswith(".tmp-step_000004") and not stale.exists()
    with pytest.raises(ValueError, match="a checkpoint of step 2 already exists"):
        _save(tmp_path, 2, model, optimizer, scheduler)


def test_latest_is_the_most_steps(tmp_path):
    model, optimizer, scheduler = _trained(0, torch.float32)
    assert latest_checkpoint(tmp_path) is None
    for step in (2, 999_999, 1_000_000, 4):  # past six digits the names no longer sort as numbers
        _save(tmp_path, step, model, optimizer, scheduler)
    (tmp_path / "checkpoints" / "step_2000000.partial").mkdir()
    assert latest_checkpoint(tmp_path).name == "step_1000000"


class _Payload:
    """An arbitrary object: weights_only loading must refuse to construct it."""


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:100]),
         "model.safetensors: cannot load"),
        (lambda p: (p / "state.pt").write_bytes(b"not a checkpoint"), "state.pt: cannot load"),
        (lambda p: torch.save({"optimizer": _Payload()}, p / "state.pt"), "state.pt: cannot load"),
        (lambda p: (p / "trainer.json").write_text("{"), "trainer.json: damaged JSON"),
        (lambda p: (p / "trainer.json").write_text(json.dumps({"format_version": 99, "step": 2})),
         "format_version 99"),
        (lambda p: (p / "config.json").unlink(), "config.json: missing"),
    ],
    ids=["truncated-weights", "garbage-state", "pickled-object", "damaged-json", "format-version", "missing-config"],
)
def test_damaged_checkpoints_are_named(tmp_path, damage, message):
    model, optimizer, scheduler = _trained(0, torch.float32)
    path = _save(tmp_path, 2, model, optimizer, scheduler)
    damage(path)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)


def test_weights_of_another_model_are_refused(tmp_path):
    model, optimizer, scheduler = _trained(0, torch.float32)
    path = _save(tmp_path, 2, model, optimizer, scheduler)
    other = nn.Sequential(nn.Linear(6, 6))
    other_optimizer = MasterWeightAdamW(other.named_parameters(), OptimizerConfig())
    with pytest.raises(ValueError, match="model.safetensors: does not match the model"):
        load_checkpoint(path, model=other, optimizer=other_optimizer,
                        scheduler=make_scheduler(other_optimizer, ScheduleConfig(), 5))
    bf16, bf16_optimizer, bf16_scheduler = _trained(0, torch.bfloat16, steps=0)
    with pytest.raises(ValueError, match="master.safetensors: cannot load"):
        load_checkpoint(path, model=bf16, optimizer=bf16_optimizer, scheduler=bf16_scheduler)
