"""HARTS inside the RL trainers people use: `harts.integrations.trl` (TRL's GRPO trainer) and
`harts.integrations.verl` (verl's training engine); each module adapts one trainer and imports it only there."""
