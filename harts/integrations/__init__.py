"""HARTS inside the RL trainers people use: `harts.integrations.trl` (TRL's GRPO trainer)."""
