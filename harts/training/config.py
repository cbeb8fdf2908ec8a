"""Configuration of `harts train`: one `@dataclass(kw_only=True)` per component, one YAML file.

`TrainConfig` composes `DataConfig`, `ExecutionConfig`, `LossConfig` (harts.objective.losses),
`OptimizerConfig`, `ScheduleConfig` (harts.optim.config; harts rl's config shares these three) and
`CheckpointConfig`; its model is `model` (a model config, randomly initialised) or `init_from` (a Hugging Face
checkpoint, whose config.json is the model config), exactly one.
`load_train_config(path, overrides)` reads one YAML file strictly (harts.config: an unknown key,
a missing required key or a wrong type is an error naming the file and the dotted key) and
applies dotted-key overrides (the CLI flags: `{"optimizer.lr": 1e-5}`) before validation.
`resolve(config, num_data_steps)` fills the fields whose defaults depend on others (the number
of steps, the planner, the backends, the dtype), so that the configuration written into
checkpoints and logs says everything the loss curve depends on. The run directory, the stop step
(`--max-steps`) and logging choices are not part of it: they do not change the curve.
 Tested in
tests/training/test_config.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from harts.config import from_dict, load_yaml_mapping
from harts.config.execution import DEVICES, DTYPES, ExecutionConfig, check_run_dtype, resolved_for_run
from harts.objective.losses import LossConfig
from harts.optim.config import OptimizerConfig, ScheduleConfig



@dataclass(kw_only=True)
class DataConfig:
    """Where the steps come from and how they are visited."""

    trees: str
    """A trees config (shipped NAME or YAML path; step i generated with `generate_step(config, seed, i)`),
    a directory of step_NNN.{npz,jsonl,jsonl.gz} files (one step each), or one step (a file, or a
    directory of other step files, read as one step)."""
    seed: int = 0
    """Seed of generated steps (a trees config only)."""
    on_policy: bool = False
    """Ignore the steps' old log-probs (ratio 1), as in the first epoch on fresh rollouts."""
    shuffle: bool = False
    """Visit the data steps of each epoch in a random order (torch's global RNG, seeded by `seed` of
    the run); otherwise in order. Training for more steps than the data holds starts new epochs."""

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"data.seed must be >= 0, got {self.seed}")


@dataclass(kw_only=True)
class CheckpointConfig:
    """When checkpoints are written (the final step always has one)."""

    every: int = 0
    """Save after every `every` steps (0 = only after the last step, or the --max-steps stop)."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"checkpoint.every must be >= 0, got {self.every}")


@dataclass(kw_only=True)
class TrainConfig:
    """Everything the loss curve of `harts train` depends on."""

    model: str | None = None
    """A shipped model config NAME (configs/models) or a YAML path; or None with `init_from`."""
    init_from: str | None = None
    """A Hugging Face checkpoint directory (Kimi-Linear or BailingHybrid, harts.model.hf) to start from instead of a
    random initialisation; its config.json gives the model config, so `model` stays None."""
    data: DataConfig
    num_steps: int | None = None
    """Optimizer steps; None = one pass over the data steps."""
    seed: int = 0
    """Weight initialisation and the global RNGs (torch, numpy, random)."""
    device: str = "cpu"
    dtype: str | None = None
    """"fp32" or "bf16" (bf16 parameters, fp32 master weights, bf16 autocast); None = bf16 on CUDA, fp32 on CPU."""
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    """How each step is planned and executed (harts.config.execution; execution default compact, dtype the
    run's)."""
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        if (self.model is None) == (self.init_from is None):
            raise ValueError("missing required key 'model' (or 'init_from': a Hugging Face checkpoint whose "
                             "config.json is the model config)" if self.model is None else
                             f"model ({self.model!r}) and init_from ({self.init_from!r}) exclude each other: "
                             "init_from's config.json is the model config")
        if self.num_steps is not None and self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        self.execution.check("execution.")
        check_run_dtype(self.dtype, self.execution)


def set_dotted(data: dict[str, Any], key: str, value: Any, where: str) -> None:
    """data["a"]["b"] = value for key "a.b", creating the inner mappings."""
    *parents, last = key.split(".")
    node = data
    for depth, name in enumerate(parents):
        node = node.setdefault(name, {})
        if not isinstance(node, dict):
            raise ValueError(f"{where}: key '{'.'.join(parents[:depth + 1])}': expected a mapping")
    node[last] = value


def train_config_from_dict(data: dict[str, Any], where: str, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Strictly build a TrainConfig from plain data (a YAML mapping, a checkpoint's config) plus overrides."""
    data = copy.deepcopy(data)
    for key, value in (overrides or {}).items():
        set_dotted(data, key, value, where)
    return from_dict(TrainConfig, data, where)


def load_train_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The YAML file at `path` (or nothing: flags only) with dotted-key `overrides`."""
    data = load_yaml_mapping(path) if path is not None else {}
    return train_config_from_dict(data, str(path) if path is not None else "command line", overrides)


def resolve(config: TrainConfig, num_data_steps: int) -> TrainConfig:
    """`config` with every None default made explicit (see the fields; the execution's by
    `ExecutionConfig.resolved`, its dtype the run's)."""
    execution = resolved_for_run(config.dtype, config.execution, config.device, "compact")
    return replace(config, execution=execution, num_steps=config.num_steps or num_data_steps, dtype=execution.dtype)
