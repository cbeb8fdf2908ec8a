"""`harts bench speedup`: the compact execution against the per-trajectory baseline, per step (DESIGN §6).

For each step both executions are planned (the baseline per-trajectory, the compact one by `--planner`), run on the
same weights with the same kernels and recomputation `--repeats` times each, interleaved after a warm-up, and
compared in one record per step (and `--variant`; a variant that changes only the compact execution reuses the
step's baseline measurement): F/B/Grad and Core speedups, compression S / C, efficiency, peak
memory, model FLOPs, and where the compact time goes. docs/benchmarks.md "How `speedup` measures a step" says how,
and the records' table beside it what every field means; docs/execution.md covers `--variant` and the
`--recompute-blocks auto` search.

One job per module, each importing only those above it:
- `recompute`: which executions `--recompute-blocks auto` searches (the search and peak memory are harts.engine's and
  harts.engine_memory's);
- `executions`: the two executions and what each runs (microbatches, StepConfig);
- `metrics`: the record's figures from the measured seconds (speedups, FLOPs, MFU, timing flags);
- `breakdown`: op-level times and the terms of the compact time beyond the ideal;
- `reuse`: which cases share a step's baseline measurement, and what of it they take;
- `measure`: one step in one process;
- `parallel`: one step on the ranks of `--parallel`;
- `records`: the headline, the printed table and error rows;
- `run`: the run over steps and variants, writing the records;
- `cli`: the command's flags and `--variant` parsing.
"""
