"""Online RL (`harts rl`): GRPO on rollout trees the model samples itself (harts.rollout), with the
compact and the per-trajectory execution side by side from the same weights and seeds.

Modules: `config` (one strict YAML file), `loop` (`run_seed`), `tracking` (W&B). Tests: tests/rl/.
"""
