"""Configuration of `harts rl`: one strict YAML file (configs/rl/NAME.yaml).

`RLConfig` composes the environment (`harts.rollout.env.LookupEnvConfig`), the supervised warm
start that makes the initial policy (`WarmStartConfig`), the sampling of trees
(`harts.rollout.generate.RolloutConfig`), how a step is executed (harts.config.execution's
`ExecutionConfig`; the execution itself is each run's, from `executions`) and the training pieces it shares with `harts train`
(`LossConfig` of harts.objective.losses, `OptimizerConfig` and `ScheduleConfig` of harts.optim.config).
`load_rl_config(path)` reads it with harts.config's strict loader (an unknown or missing key, or a wrong type, is an
error naming the file and the dotted key); `resolve` makes the defaults that depend on the device
explicit, so that a record's config says everything its curves depend on, and refuses backends
the model cannot run (fla's KDA needs chunks of 64: the `tiny` model has 16) and a `loss.pooled_balance_coeff` it
cannot give (harts.objective.step.check_pooled_balance). Tested in
tests/rl/test_config.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from harts.config import load_config, shipped_config_path
from harts.config.execution import (
    DEVICES, DTYPES, EXECUTIONS, ExecutionConfig, check_run_dtype, default_planner, resolved_for_run,
)
from harts.model.config import load_model_config, with_experts_backend
from harts.objective.losses import LossConfig
from harts.optim.config import OptimizerConfig, ScheduleConfig
from harts.rollout.env import LookupEnv, LookupEnvConfig
from harts.rollout.generate import RolloutConfig


@dataclass(kw_only=True)
class WarmStartConfig:
    """Supervised steps on a scripted agent's episodes before RL (the initial policy of both executions)."""

    steps: int = 120
    """Optimizer steps (0: RL from the random initialisation)."""
    episodes: int = 64
    """Demonstration episodes per step (one task each)."""
    accuracy: float = 0.5
    """Probability that the scripted agent takes the optimal action at a decision (else a random legal one)."""
    lr: float = 3e-3
    """AdamW's learning rate (no weight decay; gradients clipped at norm 1)."""

    def __post_init__(self) -> None:
        if self.steps < 0 or self.episodes < 1:
            raise ValueError(f"warm_start.steps must be >= 0 and warm_start.episodes >= 1, got {self.steps}, {self.episodes}")
        if not 0 <= self.accuracy <= 1:
            raise ValueError(f"warm_start.accuracy must be in [0, 1], got {self.accuracy}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"warm_start.lr must be a finite number > 0, got {self.lr}")


@dataclass(kw_only=True)
class RLConfig:
    """Everything the reward, loss and KL curves of `harts rl` depend on."""

    name: str
    """Labels the records, the W&B runs and the report."""
    model: str
    """A shipped model config NAME (configs/models) or a YAML path."""
    num_steps: int = 120
    """GRPO updates per run: steps 0..num_steps−1 sample and update, step num_steps samples the
    final policy (its reward, KL and loss, no update)."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """One pair of runs per seed: the same initial weights, tasks and sampling seeds in both executions."""
    executions: list[str] = field(default_factory=lambda: ["compact", "baseline"])
    device: str = "cpu"
    dtype: str | None = None
    """"fp32" or "bf16" (bf16 parameters with fp32 masters, as `harts train`); None = bf16 on CUDA, fp32 on CPU."""
    env: LookupEnvConfig = field(default_factory=LookupEnvConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    """How each training step is planned and run (harts.config.execution); the execution is each run's (from
    `executions`), the dtype the run's."""
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if not self.seeds or min(self.seeds) < 0 or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct integers >= 0, at least one, got {self.seeds}")
        if not self.executions or len(set(self.executions)) != len(self.executions) or not set(
                self.executions) <= set(EXECUTIONS):
            raise ValueError(f"executions must be distinct names of {EXECUTIONS}, got {self.executions}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        self.execution.check("execution.")
        if self.execution.execution is not None:
            raise ValueError(f"execution.execution: harts rl runs the executions of `executions` (got "
                             f"{self.execution.execution!r}); leave it out")
        check_run_dtype(self.dtype, self.execution)
        if self.loss.name != "grpo":
            raise ValueError(f"loss.name must be 'grpo' (the RL loop computes GRPO advantages), got {self.loss.name!r}")

    def planner(self, execution: str) -> str:
        return self.execution.planner or default_planner(execution)


def model_config_of(config: RLConfig):
    """The model config of a run: `model`'s, with the execution's experts backend when it names one."""
    return with_experts_backend(load_model_config(config.model), config.execution.experts_backend)


def load_rl_config(name_or_path: str | Path) -> RLConfig:
    """A shipped RL config by name (configs/rl/NAME.yaml: cpu, tiny, gdn-tiny, h200) or a YAML file."""
    return load_config(shipped_config_path(str(name_or_path), "rl"), RLConfig)


def resolve(config: RLConfig, where: str | Path = "rl config") -> RLConfig:
    """`config` with the device-dependent defaults (dtype, backends) made explicit; a ValueError
    (starting with `where`) for a choice the model cannot run."""
    try:
        execution = resolved_for_run(config.dtype, config.execution, config.device)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    model = model_config_of(config)
    env_vocab = LookupEnv(config.env).vocab_size
    if env_vocab > model.vocab_size:
        raise ValueError(f"{where}: env.text_vocab: the environment's {env_vocab} tokens exceed model "
                         f"{config.model}'s vocabulary ({model.vocab_size})")
    # The training step is on-policy at temperature 1 (ratio 1, no old log-probs): sampling from another
    # distribution would make every update off-policy without saying so.
    if config.rollout.temperature != 1.0 or config.rollout.top_p != 1.0:
        raise ValueError(f"{where}: rollout.temperature and rollout.top_p must be 1 for harts rl (its GRPO step is "
                         f"on-policy at temperature 1), got {config.rollout.temperature} and {config.rollout.top_p}")
    chunk = model.linear_attention.chunk_size
    if execution.kda_backend == "fla" and chunk != 64:
        raise ValueError(f"{where}: execution.kda_backend fla needs the model's KDA chunk_size 64, model "
                         f"{config.model} has {chunk}; set execution.kda_backend: torch")
    if "baseline" in config.executions:
        from harts.objective.step import check_baseline_gdn_kernel

        check_baseline_gdn_kernel(model, replace(execution, execution="baseline"), config.device,
                                  name="execution.gdn_kernel", where=f"{where}: ")
    from harts.objective.step import check_pooled_balance, runs_mtp

    check_pooled_balance(model, config.loss, str(where), mtp=runs_mtp(model, execution),
                         name="loss.pooled_balance_coeff")
    return replace(config, dtype=execution.dtype, execution=execution)
