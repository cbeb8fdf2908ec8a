"""HARTS: prefix-shared training of hybrid-attention MoE models on agentic-RL rollout trees.

Pipeline stages, imports pointing one way (the layer table: tests/test_imports.py):
config -> trees -> planning -> ops -> runtime -> model -> objective -> parallel -> rollout
-> optim, tracking, workflow -> api -> training, rl, bench, integrations -> report -> cli.
"""

from harts import log as _log  # noqa: F401  (the `harts` logger and its stderr handler)

__version__ = "0.1.0"
