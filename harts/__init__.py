"""HARTS: prefix-shared training of hybrid-attention MoE models on agentic-RL rollout trees.

Pipeline stages, dependencies pointing one way:
trees -> planning -> runtime + ops -> model -> objective -> parallel -> bench -> report.
"""

from harts import log as _log  # noqa: F401  (the `harts` logger and its stderr handler)

__version__ = "0.1.0"
