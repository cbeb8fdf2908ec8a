"""harts.training.export and `init_from`: training checkpoints to Hugging Face checkpoints and back.

- The export of a run's checkpoint (fp32 run; bf16 run with fp32 masters; tied embeddings, stored once; each
  exported in each dtype) equals
  `save_hf_checkpoint` of the model assembled from that checkpoint by hand (its parameters, a bf16 run's
  masters in their place), file for file and bit for bit; the bf16 export of a bf16 run holds its bf16 parameters.
- A run started from that export (`init_from`, fp32 and bf16) starts from its weights: with lr 0 its first
  checkpoint holds them (the expert biases move by their own update), and its loss differs from a random start.
- A damaged checkpoint (missing, extra, mis-shaped tensor; a master of an fp32 parameter, or of another dtype) and
  a path that is no run are refused in one line naming the file and the tensor.
"""

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
import yaml
from safetensors import safe_open

from harts.config import config_to_dict, from_dict, load_yaml_mapping, shipped_config_path
from harts.model.config import ModelConfig
from harts.model.hf import load_hf_checkpoint, load_hf_config, save_hf_checkpoint
from harts.model.model import HybridModel
from harts.training.config import load_train_config
from harts.training.export import export_checkpoint, find_checkpoint
from harts.training.loop import train

MICRO = str(Path(__file__).with_name("micro-trees.yaml"))


def _config(**overrides):
    values = {"model": "kimi-tiny", "data.trees": MICRO, "num_steps": 2, "seed": 3, "execution.capacity": 1024,
              "optimizer.lr": 3e-3}
    values.update(overrides)
    if "init_from" in values:
        del values["model"]
    return load_train_config(None, values)


@pytest.fixture(scope="module", params=["fp32", "bf16", "tied-fp32"])
def run(request, tmp_path_factory):
    """(dtype, run directory) of a two-step kimi-tiny run (tied: with tied embeddings, which the training
    checkpoint stores once)."""
    run_dir = tmp_path_factory.mktemp(f"run-{request.param}")
    dtype = request.param.removeprefix("tied-")
    model = "kimi-tiny"
    if request.param.startswith("tied"):
        data = load_yaml_mapping(shipped_config_path("kimi-tiny", "models"))
        model = str(run_dir.with_name(f"{run_dir.name}-model.yaml"))
        Path(model).write_text(yaml.safe_dump({**data, "name": "kimi-tiny-tied", "tie_embeddings": True}))
    train(_config(dtype=dtype, model=model), run_dir)
    return dtype, run_dir


def checkpoint_model(checkpoint: Path) -> HybridModel:
    """The fp32 model of a training checkpoint, assembled by hand: its config.json's model, its tensors, and for a
    bf16 run the fp32 masters in place of the parameters."""
    saved = json.loads((checkpoint / "config.json").read_text())
    model = HybridModel(from_dict(ModelConfig, saved["model"], "config.json"))
    tensors = safetensors.torch.load_file(str(checkpoint / "model.safetensors"))
    if (checkpoint / "master.safetensors").exists():
        tensors.update(safetensors.torch.load_file(str(checkpoint / "master.safetensors")))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in tensors or not model.config.tie_embeddings:
                tensor.copy_(tensors[name])
    return model


def read_files(root: Path) -> dict[str, dict[str, torch.Tensor] | str]:
    """Every file of a checkpoint directory: safetensors as their tensors, the rest as text."""
    found = {}
    for path in sorted(root.iterdir()):
        if path.suffix == ".safetensors":
            with safe_open(path, "pt") as handle:
                found[path.name] = {name: handle.get_tensor(name) for name in handle.keys()}
        else:
            found[path.name] = path.read_text()
    return found


def assert_same_files(actual: Path, expected: Path) -> None:
    got, want = read_files(actual), read_files(expected)
    assert got.keys() == want.keys()
    for name, content in want.items():
        if isinstance(content, str):
            assert got[name] == content, name
            continue
        assert list(got[name]) == list(content), name
        for tensor_name, tensor in content.items():
            assert got[name][tensor_name].dtype == tensor.dtype, tensor_name
            assert torch.equal(got[name][tensor_name], tensor), tensor_name


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_export_equals_saving_the_checkpoints_model(run, tmp_path, dtype):
    run_dtype, run_dir = run
    checkpoint = find_checkpoint(run_dir)
    assert checkpoint.name == "step_000002"
    found, files = export_checkpoint(run_dir, tmp_path / "exported", dtype=dtype, max_shard_bytes=100_000)
    assert found == checkpoint and len([f for f in files if f.suffix == ".safetensors"]) > 1
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    save_hf_checkpoint(checkpoint_model(checkpoint), tmp_path / "direct", dtype=torch_dtype, max_shard_bytes=100_000)
    assert_same_files(tmp_path / "exported", tmp_path / "direct")
    if run_dtype == dtype == "bf16":
        params = safetensors.torch.load_file(str(checkpoint / "model.safetensors"))
        index = json.loads((tmp_path / "exported" / "model.safetensors.index.json").read_text())
        with safe_open(tmp_path / "exported" / index["weight_map"]["lm_head.weight"], "pt") as handle:
            assert torch.equal(handle.get_tensor("lm_head.weight"), params["lm_head.weight"])


def test_export_defaults_to_the_runs_dtype(run, tmp_path):
    run_dtype, run_dir = run
    export_checkpoint(run_dir / "checkpoints" / "step_000002", tmp_path / "exported")
    written = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert written["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[run_dtype]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_run_starts_from_an_export(run, tmp_path, dtype):
    _, run_dir = run
    export_checkpoint(run_dir, tmp_path / "hf", dtype="fp32")
    records = train(_config(init_from=str(tmp_path / "hf"), num_steps=1, dtype=dtype, **{"optimizer.lr": 0.0}),
                    tmp_path / "continued")
    start = json.loads((tmp_path / "continued" / "train.jsonl").read_text().splitlines()[0])
    assert start["config"]["train"]["init_from"] == str(tmp_path / "hf") and start["config"]["train"]["model"] is None
    expected_config = load_hf_config(tmp_path / "hf")
    assert start["config"]["model"] == json.loads(json.dumps(config_to_dict(expected_config)))
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    expected, _ = load_hf_checkpoint(tmp_path / "hf", dtype=torch_dtype)
    first = tmp_path / "continued" / "checkpoints" / "step_000001"
    after = safetensors.torch.load_file(str(first / "model.safetensors"))  # tied tensors stored once
    state = expected.state_dict()
    assert set(after) <= set(state) and len(after) >= len(state) - expected.config.tie_embeddings
    for name, tensor in after.items():
        if not name.endswith("expert_bias"):
            assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name]), name
    fresh = train(_config(num_steps=1, dtype=dtype, **{"optimizer.lr": 0.0}), tmp_path / "fresh")
    assert records[0]["loss"] != fresh[0]["loss"]


def _damage_shape(checkpoint: Path, run_dtype: str) -> tuple[str, str]:
    tensors = safetensors.torch.load_file(str(checkpoint / "model.safetensors"))
    tensors["final_norm.weight"] = tensors["final_norm.weight"][:-1].clone()
    safetensors.torch.save_file(tensors, str(checkpoint / "model.safetensors"))
    return "model.safetensors", "tensor 'final_norm.weight' is"


def _damage_missing(checkpoint: Path, run_dtype: str) -> tuple[str, str]:
    tensors = safetensors.torch.load_file(str(checkpoint / "model.safetensors"))
    del tensors["final_norm.weight"]
    safetensors.torch.save_file(tensors, str(checkpoint / "model.safetensors"))
    return "model.safetensors", "missing tensor 'final_norm.weight'"


def _damage_extra(checkpoint: Path, run_dtype: str) -> tuple[str, str]:
    tensors = safetensors.torch.load_file(str(checkpoint / "model.safetensors"))
    tensors["blocks.0.mixer.g_proj.1.bias"] = torch.zeros(32)
    safetensors.torch.save_file(tensors, str(checkpoint / "model.safetensors"))
    return "model.safetensors", "unexpected tensor 'blocks.0.mixer.g_proj.1.bias'"


def _damage_master(checkpoint: Path, run_dtype: str) -> tuple[str, str]:
    if run_dtype == "fp32":  # no parameter has a master
        safetensors.torch.save_file({"final_norm.weight": torch.ones(64)}, str(checkpoint / "master.safetensors"))
        return "master.safetensors", "unexpected master weight 'final_norm.weight'"
    masters = safetensors.torch.load_file(str(checkpoint / "master.safetensors"))
    masters["final_norm.weight"] = masters["final_norm.weight"].double()
    safetensors.torch.save_file(masters, str(checkpoint / "master.safetensors"))
    return "master.safetensors", "tensor 'final_norm.weight' is F64 [64]"


@pytest.mark.parametrize("damage", [_damage_shape, _damage_missing, _damage_extra, _damage_master],
                         ids=["mis-shaped", "missing", "extra", "bad-master"])
def test_export_refuses_a_damaged_checkpoint(run, tmp_path, damage):
    run_dtype, run_dir = run
    checkpoint = tmp_path / "step_000002"
    shutil.copytree(run_dir / "checkpoints" / "step_000002", checkpoint)
    file, message = damage(checkpoint, run_dtype)
    with pytest.raises(ValueError) as error:
        export_checkpoint(checkpoint, tmp_path / "out")
    text = str(error.value)
    assert text.startswith(f"{checkpoint / file}: ") and message in text and "\n" not in text, text
    assert not (tmp_path / "out").exists()


def test_find_checkpoint_refuses_what_is_no_run(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: neither a checkpoint .no trainer.json. nor a run directory"):
        find_checkpoint(tmp_path / "empty")
    with pytest.raises(ValueError, match="absent: no such run or checkpoint directory"):
        find_checkpoint(tmp_path / "absent")
