"""`harts bench speedup`'s command line (`register`): its flags, the run flags (`VARIANT_FLAGS`: how a step runs,
with their defaults) and their argparse types, and `--variant FLAG[=VALUE],...` parsed into the run flags it
changes (`parse_variant`: the same flags without defaults, booleans taking an optional yes/no). The flags' content
is the command's interface: `harts bench speedup --help` and docs/execution.md's knob table (tests/test_docs.py)
hold it; tests/bench/speedup/test_run.py checks the flags' errors and variants.
"""

from __future__ import annotations

import argparse
from typing import Any

from harts.args import (
    EXPERT_BACKENDS, EXPERTS_BACKEND_HELP, KEEP_ATTENTION_HELP, index_list, non_negative_int, positive_int,
)
from harts.bench.speedup.recompute import AUTO, SEARCHED
from harts.bench.speedup.run import run
from harts.tracking import wandb_log

# The default capacity T, and the LM head's default chunk (harts.objective.logprobs.DEFAULT_CHUNK_ROWS; not
# imported here: torch loads lazily). The speedup report labels other values.
DEFAULT_CAPACITY = 65536
DEFAULT_CHUNK_ROWS = 4096


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("speedup", help="compact vs per-trajectory execution: speedup records")
    parser.add_argument("--model", required=True, help="configs/models NAME or a YAML path")
    parser.add_argument("--trees", required=True, help="trees config NAME or YAML path (generate), or a step path")
    parser.add_argument("--steps", type=index_list, default=None, help="step indices of a trees config (default 0)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="trees seed")
    parser.add_argument("--max-trees", type=positive_int, default=None,
                        help="use the first N task trees of each step (a slice of the same shape)")
    parser.add_argument("--model-seed", type=non_negative_int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
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
                             "compact-recompute-blocks=same follows recompute-blocks)")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the op-level breakdown")
    parser.add_argument("--profile", action="store_true",
                        help="also profile the largest microbatch of each execution (torch.profiler): the top "
                             "kernels by self device time (CPU: self CPU time) go into the record")
    parser.add_argument("--parallel", default=None, metavar="NAME",
                        help="configs/parallel NAME or a YAML path: run both executions on its ranks (spawned here, "
                             "or started by torchrun: rank 0 writes the records)")
    parser.add_argument("--out", default=None, help="records file (default reports/raw/speedup/MODEL.json)")
    parser.add_argument("--json", action="store_true", help="also print the records' headline figures as JSON")
    wandb_log.add_arguments(parser)
    parser.set_defaults(run=run, files=lambda a: ([a.out], [a.trees]))


# The flags a `--variant` may change: how a step runs, not the weights (the model's shape, seed and parameter
# dtype), the device or the trees, so that one process measures every variant on the same weights and compiled
# kernels. The experts backend is one: its three backends hold the same parameters.
VARIANT_FLAGS = ("planner", "capacity", "recompute", "recompute-blocks", "compact-recompute-blocks",
                 "recompute-by-rows", "keep-attention", "keep-kda-intermediates",
                 "attention-backend", "compact-attention-backend", "kda-backend", "experts-backend",
                 "logprob-grad-precision", "logprob-chunk-rows", "repeats")


def _add_run_flags(parser: argparse.ArgumentParser, variant: bool = False) -> None:
    """The `VARIANT_FLAGS` with their defaults; for a variant's parser (`variant`), without defaults (only the
    flags it names are set) and with the booleans taking an optional yes/no."""

    def add(name: str, *, boolean: bool = False, **kwargs) -> None:
        if variant:
            kwargs.pop("default", None)
            if boolean:
                kwargs.update(nargs="?", const=True, type=yes_no)
        elif boolean:
            kwargs["action"] = "store_true"
        parser.add_argument(name, **kwargs)

    add("--planner", default="harts")
    add("--capacity", type=positive_int, default=DEFAULT_CAPACITY)
    add("--recompute", boolean=True, help="full per-layer activation recomputation")
    add("--recompute-blocks", type=all_auto_or_positive_int if variant else auto_or_positive_int, default=None,
        metavar="N", help="with --recompute: recompute only blocks 0..N-1, the others keep their activations "
                          "(Megatron's block method; default: every block); auto: the fewest with which a whole "
                          "step of each execution runs in the GPU's memory (searched by untimed steps; one process "
                          "on CUDA)")
    add("--compact-recompute-blocks", type=same_or_compact_blocks if variant else compact_blocks,
        default=None, metavar="N", help="with --recompute: the compact execution's --recompute-blocks (default: the "
                                        "same), so that each execution recomputes what its own memory needs (the "
                                        "compact one has fewer rows); auto as there; within-baseline: the fewest "
                                        "with which a compact step also peaks no higher than a baseline step")
    add("--recompute-by-rows", boolean=True,
        help="with --recompute-blocks: a microbatch smaller than another of the step keeps more blocks, in "
             "proportion to its rows (KDA and ancestor-KV rows too), within that one's activation memory")
    add("--keep-attention", boolean=True, help=KEEP_ATTENTION_HELP)
    add("--keep-kda-intermediates", boolean=True,
        help="with --recompute and the fla KDA (the CUDA default): the recomputed blocks' KDA calls keep fla's "
             "intermediates (WY factors, gated q/k, chunk states) from the recomputation for the backward instead "
             "of computing them again (a transient of one block's intermediates)")
    add("--attention-backend", default=None,
        help="MLA backend, naive|sdpa|varlen|flex|cudnn|flash4 (default: sdpa on CPU, varlen on CUDA)")
    add("--compact-attention-backend", default=None,
        help="MLA backend of the compact execution only (default: --attention-backend), e.g. flex: "
             "the DFS tree mask over the compact rows, without the ancestor-KV copies of varlen")
    add("--kda-backend", default=None)
    add("--experts-backend", default=None, choices=EXPERT_BACKENDS, help=EXPERTS_BACKEND_HELP)
    add("--logprob-grad-precision", choices=("fp32", "input"), default="fp32",
        help="the LM head's logit gradients: fp32 (TF32 gradient matmuls for bf16 on CUDA) or input "
             "(rounded once to bf16, bf16 tensor-core matmuls)")
    add("--logprob-chunk-rows", type=positive_int, default=DEFAULT_CHUNK_ROWS, metavar="N",
        help="rows of the LM head's logits formed at a time (its transient memory: N x vocabulary fp32; default "
             f"{DEFAULT_CHUNK_ROWS:,})")
    add("--repeats", type=positive_int, default=3)


def yes_no(text: str) -> bool:
    if text in ("yes", "no"):
        return text == "yes"
    raise argparse.ArgumentTypeError(f"expected yes or no, got {text!r}")


def positive_int_or(text: str, words: tuple[str, ...]) -> int | str:
    """A positive int or one of `words` (kept as the text), the error naming both."""
    if text in words:
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError as error:
        listed = f" or {words[0]}" if len(words) == 1 else f", {', '.join(words[:-1])} or {words[-1]}"
        raise argparse.ArgumentTypeError(str(error).replace(", got", f"{listed}, got", 1)) from None


def auto_or_positive_int(text: str) -> int | str:
    return positive_int_or(text, (AUTO,))


def all_auto_or_positive_int(text: str) -> int | str | None:
    return None if text == "all" else auto_or_positive_int(text)


def compact_blocks(text: str) -> int | str:
    """--compact-recompute-blocks: a positive int, auto or within-baseline."""
    return positive_int_or(text, SEARCHED)


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
