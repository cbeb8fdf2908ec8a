"""Parallel execution of the plain model on torch.distributed: DP, TP, SP, PP, EP and their combinations.

- config.py: `ParallelConfig` (configs/parallel/NAME.yaml) and its checks against a model.
- groups.py: process groups (DeviceMesh over megatron-core's rank order).
- comm.py: collectives with autograd (megatron's tensor-parallel mappings, row sharding, all-to-all).
- tensor.py: TP/SP sharding of KDA, MLA and SwiGLU layers; expert.py: `ParallelMoE` (TP/SP/EP).
- model.py: `parallelize(model, groups)` and the stage forward; pipeline.py: the 1F1B schedule.
- step.py: `run_parallel_step`, the parallel counterpart of harts.objective.step.run_step; balance.py: transformers'
  pooled load-balancing loss of a microbatch across the pipeline stages.
- launch.py: spawning the ranks; verify.py: comparison with the single-process baseline.
Everything is tested against the single-process computation (tests/parallel).
"""
