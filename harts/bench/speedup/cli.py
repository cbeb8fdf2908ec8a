"""`harts bench speedup`'s command line (`register`): its flags, the run flags (`VARIANT_FLAGS`: how a step runs,
with their defaults) and their argparse types, and `--variant FLAG[=VALUE],...` parsed into the run flags it
changes (`parse_variant`: the same flags without defaults, booleans taking an optional yes/no). The flags' content
is the command's interface: `harts bench speedup --help` and docs/execution.md's knob table (tests/test_docs.py)
hold it; tests/bench/speedup/test_run.py checks the flags' errors and variants.
"""

from __future__ import annotations

import argparse
from typing import Any

from harts.args import index_list, non_negative_int, non_negative_int_or, positive_int, records_file
from harts.bench.outputs import records_files
from harts.bench.speedup.recompute import SEARCHED
from harts.bench.speedup.executions import RUN_KNOBS
from harts.bench.speedup.reuse import COMPACT_ONLY
from harts.bench.speedup.run import run, run_variants
from harts.config import execution
from harts.tracking import wandb_log



def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("speedup", help="compact vs per-trajectory execution: speedup records")
    parser.add_argument("--model", required=True, help="configs/models NAME or a YAML path")
    parser.add_argument("--trees", required=True, help="trees config NAME or YAML path (generate), or a step path")
    parser.add_argument("--steps", type=index_list, default=None, help="step indices of a trees config (default 0)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="trees seed")
    parser.add_argument("--max-trees", type=positive_int, default=None,
                        help="use the first N task trees of each step (a slice of the same shape)")
    parser.add_argument("--model-seed", type=non_negative_int, default=0)
    parser.add_argument("--device", choices=execution.DEVICES, default="cpu")
    execution.add_arguments(parser, ("dtype",))
    parser.add_argument("--params", choices=("fp32", "bf16"), default=None,
                        help="parameter dtype: bf16 = bf16 parameters with every microbatch's gradients added "
                             "into fp32 buffers (megatron's main_grad), no per-use casts; fp32 = fp32 parameters "
                             "cast by autocast at every use. Default: bf16 with --dtype bf16 in one process, else fp32")
    _add_run_flags(parser)
    parser.add_argument("--variant", action="append", type=parse_variant, default=None, metavar="FLAG[=VALUE],...",
                        help="after the run's own settings, measure each step again with these run flags changed "
                             "(repeatable; one record per step and variant, all in this process on the same weights "
                             "and compiled kernels), e.g. --variant recompute-blocks=14 "
                             "--variant recompute-blocks=14,keep-attention. Flags: "
                             + ", ".join(VARIANT_FLAGS) + " (booleans take =yes or =no; recompute-blocks=all or =auto; "
                             "compact-recompute-blocks=same follows recompute-blocks). A variant whose baseline would "
                             "run as an earlier case's of the step (it changes only "
                             + " or ".join(execution.flag(name).removeprefix("--") for name in COMPACT_ONLY)
                             + ", planner, or memory-margin where --recompute-blocks is not auto; not repeats) "
                             "takes that case's baseline measurement (timings, --recompute-blocks "
                             "auto search, peak memory, the breakdown's and profile's baseline ops) and measures "
                             "the compact execution alone; its record's results.baseline_reused_from names that "
                             "case")
    parser.add_argument("--no-reuse-baseline", action="store_true",
                        help="measure every variant's baseline again, even where an earlier case of the step "
                             "measured it with the same settings")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the op-level breakdown")
    parser.add_argument("--profile", action="store_true",
                        help="also profile the largest microbatch of each execution (torch.profiler): the top "
                             "kernels by self device time (CPU: self CPU time) go into the record")
    parser.add_argument("--parallel", default=None, metavar="NAME",
                        help="configs/parallel NAME or a YAML path: run both executions on its ranks (spawned here, "
                             "or started by torchrun: rank 0 writes the records)")
    parser.add_argument("--out", type=records_file, default=None,
                        help="records file (default reports/raw/speedup/MODEL.json)")
    parser.add_argument("--json", action="store_true", help="also print the records' headline figures as JSON")
    wandb_log.add_arguments(parser)
    parser.set_defaults(run=run, files=records_files("speedup"))


# The flags a `--variant` may change: how a step runs, not the weights (the model's shape, seed and parameter
# dtype), the device or the trees, so that one process measures every variant on the same weights and compiled
# kernels. The experts backend is one: its three backends hold the same parameters.
VARIANT_FLAGS = (*(execution.flag(name).removeprefix("--") for name in RUN_KNOBS), "compact-recompute-blocks",
                 "compact-attention-backend", "repeats")


def _add_run_flags(parser: argparse.ArgumentParser, variant: bool = False) -> None:
    """The `VARIANT_FLAGS` with their defaults (the knobs' as harts.config.execution makes them, the compact
    execution's own two, --repeats); for a variant's parser (`variant`), without defaults (only the flags it
    names are set) and with the booleans taking an optional yes/no."""
    help_of = execution.field_help()
    own = {
        "planner": dict(default="harts", help="The compact execution's microbatch planner (the baseline's is "
                                              "per-trajectory; default: harts)."),
        "recompute_blocks": dict(
            type=all_auto_or_blocks_count if variant else execution.auto_or_blocks_count,
            help=help_of["recompute_blocks"] + " Here auto searches each execution for itself (untimed steps; one "
                                               "process on CUDA)."),
    }
    for name in RUN_KNOBS:
        option, keywords = execution.argument(name, default=not variant)
        keywords.update(own.get(name, {}))
        if variant:
            keywords.pop("default", None)
            if keywords.get("action") == "store_true":
                del keywords["action"]
                keywords.update(nargs="?", const=True, type=yes_no)
        parser.add_argument(option, **keywords)
    defaults = {} if variant else {"default": None}
    parser.add_argument("--compact-recompute-blocks", type=same_or_compact_blocks if variant else compact_blocks,
                        metavar="N", help="with --recompute: the compact execution's --recompute-blocks (default: the "
                                          "same), so that each execution recomputes what its own memory needs (the "
                                          "compact one has fewer rows); auto as there; within-baseline: the fewest "
                                          "with which a compact step also peaks no higher than a baseline step",
                        **defaults)
    parser.add_argument("--compact-attention-backend", choices=execution.ATTENTION_BACKENDS,
                        help="MLA backend of the compact execution only (default: --attention-backend), e.g. flex: "
                             "the DFS tree mask over the compact rows, without the ancestor-KV copies of varlen",
                        **defaults)
    parser.add_argument("--repeats", type=positive_int, **({} if variant else {"default": 3}),
                        help="timed steps of each execution, interleaved, after a warm-up (default 3)")


def yes_no(text: str) -> bool:
    if text in ("yes", "no"):
        return text == "yes"
    raise argparse.ArgumentTypeError(f"expected yes or no, got {text!r}")


def all_auto_or_blocks_count(text: str) -> int | str | None:
    return None if text == "all" else execution.auto_or_blocks_count(text)


def compact_blocks(text: str) -> int | str:
    """--compact-recompute-blocks: a non-negative int, auto or within-baseline."""
    return non_negative_int_or(text, SEARCHED)


def same_or_compact_blocks(text: str) -> int | str | None:
    """A variant's compact-recompute-blocks: `same` follows recompute-blocks again (the flag's default)."""
    return None if text == "same" else compact_blocks(text)


class _VariantParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise argparse.ArgumentTypeError(message)


def parse_variant(text: str) -> dict[str, Any]:
    """argparse type of `--variant`: `FLAG[=VALUE]` items joined by commas, each one of `VARIANT_FLAGS`; the
    run flags they set (dest → value), in a dict with the text itself under "variant"."""
    argv = []
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        if name not in VARIANT_FLAGS:
            raise argparse.ArgumentTypeError(f"{text!r}: {name!r} is not one of {', '.join(VARIANT_FLAGS)}")
        argv += [f"--{name}", value] if sep else [f"--{name}"]
    parser = _VariantParser(prog="--variant", add_help=False, argument_default=argparse.SUPPRESS)
    _add_run_flags(parser, variant=True)
    try:
        overrides = vars(parser.parse_args(argv))
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    return {**overrides, "variant": text}


PIPELINE_KEYS = (*(name for name in RUN_KNOBS if name != "planner"), "compact_recompute_blocks")
"""The keys of the pipeline's `speedup` section that are run flags of the same name (its `planners` are a
wildcard of the jobs, its `device` and `dtype` flags of the rule)."""


def pipeline_flags(section: dict[str, Any]) -> list[str]:
    """The run flags of the pipeline's `speedup` section: each of `PIPELINE_KEYS` it sets (a boolean that is
    true, any other value but null)."""
    flags = []
    for key in PIPELINE_KEYS:
        value = section.get(key)
        if value is True:
            flags.append(execution.flag(key))
        elif value is not None and value is not False:
            flags += [execution.flag(key), str(value)]
    return flags


def check_pipeline_section(section: dict[str, Any]) -> None:
    """The pipeline's `speedup` section checked as `harts bench speedup` checks its flags, for every planner and
    parallel configuration the jobs will run (ValueError starting "pipeline config: speedup: ")."""
    parser = argparse.ArgumentParser(prog="harts bench", add_help=False)
    register(parser.add_subparsers())
    for planner in section["planners"]:
        for parallel in section["parallel"]:
            argv = ["speedup", "--model", "m", "--trees", "t", "--device", section["device"], "--dtype",
                    section["dtype"], "--planner", planner, *pipeline_flags(section)]
            if parallel != "single":
                argv += ["--parallel", parallel]
            try:
                run_variants(parser.parse_args(argv))
            except SystemExit:
                raise ValueError(f"pipeline config: speedup: harts bench speedup refuses {' '.join(argv[5:])} "
                                 "(above)") from None
            except ValueError as error:
                raise ValueError(f"pipeline config: speedup: {error}") from None
