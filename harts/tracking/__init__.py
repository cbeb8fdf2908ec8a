"""Where measurements and runs are recorded: JSON records with their environment (records), W&B runs of benchmark
records (wandb_log) and of training runs (wandb_run). Shared by the benchmarks, harts train and harts rl."""
