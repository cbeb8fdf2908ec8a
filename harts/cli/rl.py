"""`harts rl`: online GRPO on self-sampled rollout trees, compact and per-trajectory execution side by side.

`harts rl --config configs/rl/cpu.yaml --out reports/raw/rl/cpu/seed_000.json --seeds 0`
runs, for each seed, the config's executions in lockstep from the same initial weights and
sampling seeds (harts.rl.loop) and writes one record per (seed, execution) (harts.tracking.records:
config, environment as the seed's run started, git sha, hardware; results: the step records and a
summary). A run that
fails (a non-finite loss or gradient) becomes a record with an `error` and the command exits 1
after the other seeds ran; a bad config or option exits 2. `--device`, `--dtype` and the backends
override the config's (`--device cuda`: bf16 and the GPU backends unless given). `--wandb` logs every
step live (one W&B run per seed). Tested in tests/cli/test_rl.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from harts.args import index_list, positive_int, records_file
from harts.config import execution
from harts.tracking import wandb_log


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("rl", help="online GRPO on self-sampled rollout trees, both executions side by side")
    parser.add_argument("--config", required=True,
                        help="RL config (harts.rl.config.RLConfig): a shipped one by name (cpu, tiny, gdn-tiny, h200) "
                             "or a YAML path")
    parser.add_argument("--out", type=records_file, required=True,
                        help="records file (.json: a list; .jsonl: one record per line)")
    parser.add_argument("--seeds", type=index_list, default=None, metavar="S,S,...",
                        help="run these seeds (default: the config's seeds)")
    parser.add_argument("--num-steps", type=positive_int, default=None, metavar="N", help="override num_steps")
    parser.add_argument("--device", choices=execution.DEVICES, default=None, help="override device")
    parser.add_argument("--dtype", choices=execution.DTYPES, default=None,
                        help="override dtype (bf16: bf16 parameters with fp32 master weights)")
    knobs = parser.add_argument_group("execution (override the config's execution section)")
    execution.add_arguments(knobs, exclude=("execution", "dtype"), overrides=True,
                            recompute_blocks={"type": execution.auto_or_blocks_count})
    parser.add_argument("--wandb", action="store_true",
                        help="log every step to W&B (offline unless WANDB_MODE or WANDB_API_KEY say otherwise; "
                             "implied by any --wandb-* flag)")
    wandb_log.add_arguments(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")
    parser.set_defaults(run=run_rl, files=lambda a: ([a.out], [a.config]))


def summary(steps: list[dict]) -> dict:
    """Reward at the first and last step, and medians of the per-step times over the update steps."""
    updates = [s for s in steps if s["update"]]

    def median(key: str) -> float:
        return statistics.median(s["seconds"][key] for s in updates)

    return {
        "reward_first": steps[0]["reward"], "reward_last": steps[-1]["reward"],
        "kl_last": steps[-1]["kl"], "compression_mean": statistics.fmean(s["compression"] for s in steps),
        "train_seconds_median": median("train"), "forward_backward_seconds_median": statistics.median(
            s["seconds"]["forward"] + s["seconds"]["backward"] for s in updates),
        "sample_seconds_median": median("sample"), "reference_seconds_median": median("reference"),
    }


def run_rl(args: argparse.Namespace) -> int:
    from harts.rl.config import load_rl_config, resolve
    from harts.rl.loop import run_config, run_seed
    from harts.rl.tracking import RLTracker
    from harts.tracking.records import environment, error_message, make_record, write_records

    config = load_rl_config(args.config)
    if args.num_steps is not None:
        config = replace(config, num_steps=args.num_steps)
    if args.device is not None and args.device != config.device:
        # The dtype and backends default by device: a config's CPU choices do not carry over to CUDA.
        config = replace(config, device=args.device, dtype=None,
                         execution=replace(config.execution, dtype=None, attention_backend=None, kda_backend=None))
    if args.dtype is not None:
        config = replace(config, dtype=args.dtype, execution=replace(config.execution, dtype=None))
    config = replace(config, execution=replace(config.execution, **execution.from_arguments(args, given=True)))
    config = resolve(config, where=args.config)
    seeds = args.seeds if args.seeds is not None else config.seeds
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"harts rl: --seeds {','.join(map(str, seeds))}: a seed is repeated")
    if config.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"{args.config}: device cuda: no CUDA device is available")
    records, failed = [], False
    for seed in seeds:
        # Failed until run_seed returns: any exception (not only a ValueError) closes the W&B run as failed.
        tracker, seed_failed = None, True
        # The environment as the seed's run starts (git sha and dirty flag of the code that runs, not of
        # whatever the checkout holds minutes later when the record is written).
        started = environment()
        if wandb_log.requested(args):
            tracker = RLTracker.start({"config": run_config(config, seed), "environment": started},
                                      wandb_log.options(args), directory=Path(args.out).resolve().parent)
        try:
            warm, by_execution = run_seed(config, seed, progress=not args.no_progress, tracker=tracker)
        except ValueError as error:
            failed = True
            seed_records = [make_record("rl", {**run_config(config, seed), "execution": e},
                                        error=error_message(error)) for e in config.executions]
        else:
            seed_failed = False
            seed_records = [make_record("rl", {**run_config(config, seed), "execution": e},
                                        {"warm_start": warm, "steps": steps, "summary": summary(steps)})
                            for e, steps in by_execution.items()]
        finally:
            if tracker is not None:
                tracker.finish(seed_failed)
        records += [{**record, "environment": started} for record in seed_records]
        # After every seed: a later seed that crashes (a bug, out of memory) does not lose the finished ones.
        write_records(records, args.out)
    summaries = [{"seed": r["config"]["seed"], "execution": r["config"]["execution"],
                  **(r["results"]["summary"] if "results" in r else {"error": r["error"]})} for r in records]
    if args.json:
        print(json.dumps(summaries))
    else:
        for s in summaries:
            if "error" in s:
                print(f"seed {s['seed']} {s['execution']}: error: {s['error']}")
            else:
                print(f"seed {s['seed']} {s['execution']}: reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}, "
                      f"KL {'n/a' if s['kl_last'] is None else format(s['kl_last'], '.4g')}, S/C {s['compression_mean']:.2f}, training step "
                      f"{s['train_seconds_median']:.3f} s (sampling {s['sample_seconds_median']:.3f} s, outside it)")
        print(f"records: {args.out}")
    return 1 if failed else 0
