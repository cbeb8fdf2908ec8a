"""The RL objective on compact execution: compact log-probs, target shifting, GRPO/PPO losses."""

from harts.objective.logprobs import compact_logprobs, iter_compact_logits, naive_compact_logprobs
from harts.objective.losses import GRPOConfig, PolicyLoss, PPOConfig, aggregate, grpo_loss, k3_kl, ppo_loss
from harts.objective.targets import SemanticTargets, semantic_targets, semantic_targets_from_step

__all__ = [
    "GRPOConfig",
    "PPOConfig",
    "PolicyLoss",
    "SemanticTargets",
    "aggregate",
    "compact_logprobs",
    "grpo_loss",
    "iter_compact_logits",
    "k3_kl",
    "naive_compact_logprobs",
    "ppo_loss",
    "semantic_targets",
    "semantic_targets_from_step",
]
