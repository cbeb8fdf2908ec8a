"""Training over a sequence of RL steps: AdamW with fp32 master weights, an LR schedule, gradient
clipping, the expert-bias update, and atomic checkpoints with exact resume (`harts train`).

Modules: `config` (one dataclass per component, one strict YAML file), `data` (the steps of a
run), `optim` (master-weight AdamW, schedule, clipping), `checkpoint` (atomic save, load without
unpickling), `loop` (`train`). Tests: tests/training/.
"""

from harts.training.config import TrainConfig, load_train_config
from harts.training.loop import train

__all__ = ["TrainConfig", "load_train_config", "train"]
