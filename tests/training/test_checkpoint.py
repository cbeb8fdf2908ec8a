import json
import random

import numpy as np
import pytest
import safetensors.torch
import torch
from torch import nn

from harts.optim.adamw import MasterWeightAdamW, make_scheduler
from harts.optim.config import OptimizerConfig, ScheduleConfig
from harts.training import checkpoint as checkpoint_module
from harts.training.checkpoint import (
    latest_checkpoint, load_checkpoint, read_metadata, remove_stale, save_checkpoint,
)


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


CONFIG = {"train": {"a": 1}, "model": {"b": 2}}


def _save(run_dir, step, model, optimizer, scheduler, order=(2, 0, 1)):
    return save_checkpoint(run_dir, step, model=model, optimizer=optimizer, scheduler=scheduler,
                           trainer={"epoch_order": list(order), "torch_threads": 1}, config=CONFIG,
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
    assert read_metadata(path)[1] == CONFIG
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


@pytest.mark.parametrize("where", ["_write_json", "torch.save"])
def test_a_failed_save_leaves_no_checkpoint(tmp_path, monkeypatch, where):
    model, optimizer, scheduler = _trained(0, torch.float32)
    _save(tmp_path, 2, model, optimizer, scheduler)

    def crash(*args, **kwargs):
        # torch.save reports a full disk as a RuntimeError without a path
        raise (OSError if where == "_write_json" else RuntimeError)("disk full")

    if where == "torch.save":
        monkeypatch.setattr(checkpoint_module.torch, "save", crash)
    else:
        monkeypatch.setattr(checkpoint_module, where, crash)
    with pytest.raises(OSError, match=r"checkpoints/step_000004: could not write the checkpoint \(disk full\)"):
        _save(tmp_path, 4, model, optimizer, scheduler)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000002"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]
    with pytest.raises(ValueError, match="a checkpoint of step 2 already exists"):
        _save(tmp_path, 2, model, optimizer, scheduler)


def test_a_killed_save_is_removed_as_stale(tmp_path):
    model, optimizer, scheduler = _trained(0, torch.float32)
    _save(tmp_path, 2, model, optimizer, scheduler)
    (tmp_path / "checkpoints" / ".tmp-step_000004-123").mkdir()  # what a SIGKILL mid-save leaves
    assert latest_checkpoint(tmp_path).name == "step_000002"
    (stale,) = remove_stale(tmp_path)
    assert stale.name == ".tmp-step_000004-123" and not stale.exists()


def test_latest_is_the_most_steps(tmp_path):
    model, optimizer, scheduler = _trained(0, torch.float32)
    assert latest_checkpoint(tmp_path) is None
    for step in (2, 999_999, 1_000_000, 4):  # past six digits the names no longer sort as numbers
        _save(tmp_path, step, model, optimizer, scheduler)
    (tmp_path / "checkpoints" / "step_2000000.partial").mkdir()
    assert latest_checkpoint(tmp_path).name == "step_1000000"


class _Payload:
    """An arbitrary object: weights_only loading must refuse to construct it."""


def _edit(path, **changes):
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _edit_state(path, change):
    state = torch.load(path / "state.pt", weights_only=True)
    change(state)
    torch.save(state, path / "state.pt")


def _resave(path, dtype):
    tensors = safetensors.torch.load_file(str(path))
    safetensors.torch.save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, str(path))


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
        (lambda p: _edit(p / "trainer.json", step=None), "trainer.json: missing key 'step'"),
        (lambda p: _edit(p / "trainer.json", step="2"), "trainer.json: 'step' must be a non-negative integer, got str"),
        (lambda p: _edit(p / "trainer.json", step=True), "'step' must be a non-negative integer, got bool"),
        (lambda p: _edit(p / "trainer.json", step=3), "trainer.json: 'step' is 3 but the directory is step_000002"),
        (lambda p: _edit(p / "trainer.json", epoch_order=[0, 0, 1]), "'epoch_order' must be a permutation"),
        (lambda p: _edit(p / "trainer.json", epoch_order="012"), "'epoch_order' must be a permutation"),
        (lambda p: _edit(p / "trainer.json", torch_threads=0), "'torch_threads' must be a positive integer"),
        (lambda p: _edit(p / "trainer.json", data_sha256="ab"), "'data_sha256' must be a list of strings"),
        (lambda p: _edit(p / "config.json", train=[1]), "config.json: 'train' must be an object, got list"),
        (lambda p: torch.save([1, 2], p / "state.pt"), "state.pt: expected a dict, got list"),
        (lambda p: torch.save({"optimizer": {}, "scheduler": {}}, p / "state.pt"), "state.pt: 'rng' must be a dict"),
        (lambda p: _edit_state(p, lambda s: s["rng"].update(python="x")), "state.pt: cannot load"),
        (lambda p: _edit_state(p, lambda s: s["rng"].update(torch=torch.zeros(3))), "state.pt: cannot load"),
        (lambda p: _edit_state(p, lambda s: s["optimizer"].update(state=[])), "state.pt: cannot load"),
        (lambda p: _edit_state(p, lambda s: s["scheduler"].clear() or s["rng"].pop("numpy")), "state.pt: cannot load"),
        (lambda p: _resave(p / "model.safetensors", torch.bfloat16),
         "model.safetensors: tensor 'bias_E' is BF16 \\[3\\], the model's is F32 \\[3\\]"),
    ],
    ids=["truncated-weights", "garbage-state", "pickled-object", "damaged-json", "format-version", "missing-config",
         "no-step", "string-step", "bool-step", "step-not-directory", "order-repeats", "order-string", "zero-threads",
         "digests-string", "train-list", "state-list", "state-no-rng", "python-rng-string", "torch-rng-short",
         "optimizer-state-list", "numpy-rng-missing", "weights-resaved-bf16"],
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
    with pytest.raises(ValueError, match=r"model.safetensors: tensor '[\w.]+' is F32 \[\d+(, \d+)?\], the model's is BF16"):
        load_checkpoint(path, model=bf16, optimizer=bf16_optimizer, scheduler=bf16_scheduler)


def test_masters_resaved_in_bf16_are_refused(tmp_path):
    model, optimizer, scheduler = _trained(0, torch.bfloat16)
    path = _save(tmp_path, 2, model, optimizer, scheduler)
    _resave(path / "master.safetensors", torch.bfloat16)
    with pytest.raises(ValueError, match="master weight 'embed.weight' is torch.bfloat16 \\(9, 6\\), the run's torch.float32"):
        load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)
