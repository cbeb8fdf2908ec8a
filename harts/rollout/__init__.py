"""Rollouts sampled by the model itself: an environment with tool calls (`env`) and the batched
sampler that grows rollout trees through it (`generate`, on harts.model.decode). Tests: tests/rollout/."""
