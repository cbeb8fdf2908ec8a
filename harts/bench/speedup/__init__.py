"""`harts bench speedup`: the compact execution against the per-trajectory baseline, per step (DESIGN §6).

For each step both executions are planned (the baseline per-trajectory, the compact one by `--planner`), run on the
same weights with the same kernels and recomputation `--repeats` times each, interleaved after a warm-up, and
compared in one record per step (and `--variant`): F/B/Grad and Core speedups, compression S / C, efficiency, peak
memory, model FLOPs, and where the compact time goes. docs/benchmarks.md "How `speedup` measures a step" says how,
and the records' table beside it what every field means; docs/execution.md covers `--variant` and the
`--recompute-blocks auto` search.

One job per module, each importing only those above it:
- `memory`: peak memory of a region, device sync, freeing what a case left;
- `executions`: the two executions and what each runs (microbatches, StepConfig);
- `metrics`: the record's figures from the measured seconds (speedups, FLOPs, MFU, timing flags);
- `recompute`: the search for the fewest recomputed blocks that fit;
- `breakdown`: op-level times and the terms of the compact time beyond the ideal;
- `measure`: one step in one process;
- `parallel`: one step on the ranks of `--parallel`;
- `records`: the headline, the printed table and error rows;
- `run`: the run over steps and variants, writing the records;
- `cli`: the command's flags and `--variant` parsing.
"""
