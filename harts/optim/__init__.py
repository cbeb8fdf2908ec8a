"""The optimizer shared by harts train and harts rl: AdamW with fp32 masters and the learning-rate schedule (adamw),
their config sections (config) and one update after a step's backward (update)."""
