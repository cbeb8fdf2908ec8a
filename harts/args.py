"""Argument types and the one-line error shared by every command line of harts: the `harts` subcommands (harts.cli),
the benchmarks' parsers (harts.bench) and `python -m harts.workflow.devices`. No heavy imports (`harts trees` and
`harts plan` start fast) and nothing of harts above harts.config, so that any layer's parser may use it.

Numeric options are checked when parsed (argparse's `int`/`float` take "nan", "inf" and negatives),
so a bad value stops the command with `harts: error: ...` before any work. Tested in
tests/test_args.py.
"""

from __future__ import annotations

import argparse
import math
import sys

from harts.config import INT_LIMIT


def print_error(message: str) -> None:
    """`harts: error: MESSAGE` on stderr in one write: the ranks of a torchrun job share the stream, and a line
    written in two pieces (as `print` does) can be split by another rank's line."""
    sys.stderr.write(f"harts: error: {message}\n")
    sys.stderr.flush()


def index_list(text: str) -> list[int]:
    """argparse type of `--steps 0,3,7`: comma-separated non-negative integers, at least one."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative step indices, got {text!r}")
    return values


def records_file(text: str) -> str:
    """argparse type of a records output (`--out`): a path ending .json (a list) or .jsonl (one record per line),
    refused before any work rather than written in a format its readers (harts.report) do not take."""
    if not text.endswith((".json", ".jsonl")):
        raise argparse.ArgumentTypeError(f"expected a records file ending .json or .jsonl, got {text!r}")
    return text


def name_list(names: tuple[str, ...], what: str = "name"):
    """argparse type of `--planners harts,treetrain`: comma-separated `names`, at least one, none twice (`what`
    names an item in the errors)."""
    def parse(text: str) -> list[str]:
        values = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [v for v in values if v not in names]
        if not values or unknown:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown[0] if unknown else text!r} "
                                             f"(choose from {', '.join(names)})")
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"{what} listed twice in {text!r}")
        return values
    return parse


def _number(text: str, kind: type, minimum: float, inclusive: bool, expected: str):
    """`text` as an int below INT_LIMIT or a finite float, of at least (or, not `inclusive`, above)
    `minimum`."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    # An int has no NaN and may be too large for a float: compare it with the limit instead.
    bounded = value < INT_LIMIT if kind is int else math.isfinite(value)
    if not (bounded and (value >= minimum if inclusive else value > minimum)):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type of a count or size: an integer >= 1."""
    return _number(text, int, 1, True, "a positive integer below 2^62")


def non_negative_int_or(text: str, words: tuple[str, ...]) -> int | str:
    """argparse type of a count (0 included) that also takes one of a few `words` (kept as the text), the error
    naming both."""
    if text in words:
        return text
    try:
        return non_negative_int(text)
    except argparse.ArgumentTypeError as error:
        listed = f" or {words[0]}" if len(words) == 1 else f", {', '.join(words[:-1])} or {words[-1]}"
        raise argparse.ArgumentTypeError(str(error).replace(", got", f"{listed}, got", 1)) from None


def non_negative_int(text: str) -> int:
    """argparse type of a seed or of a count that may be 0: an integer >= 0 (numpy's seeds are non-negative)."""
    return _number(text, int, 0, True, "a non-negative integer below 2^62")


def positive_float(text: str) -> float:
    """argparse type of a duration: a finite number > 0."""
    return _number(text, float, 0.0, False, "a finite number > 0")


def non_negative_float(text: str) -> float:
    """argparse type of a coefficient or clip ratio: a finite number >= 0."""
    return _number(text, float, 0.0, True, "a finite number >= 0")


def fraction(text: str) -> float:
    """argparse type of a share of a whole (a memory margin): a finite number >= 0 and < 1."""
    value = _number(text, float, 0.0, True, "a number >= 0 and < 1")
    if value >= 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 and < 1, got {text!r}")
    return value


# harts.objective.losses' choices, spelled out so that the CLI builds without importing torch
# (tests/cli/test_train.py checks them against the losses).
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LOSS_SURROGATES = ("clip", "cispo", "sapo", "vespo")
LOSS_IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
LOSS_KL_ESTIMATORS = tuple(f"{name}{suffix}" for suffix in ("", "+")
                           for name in ("k1", "abs", "k2", "k3", "low_var_kl"))
_BOTH, _GRPO = ("grpo", "ppo"), ("grpo",)
LOSS_OPTIONS = (
    # (GRPOConfig/PPOConfig field, the losses that have it, argparse keywords): the flag is --FIELD-WITH-DASHES.
    # Every field of both configs is here (tested); docs/losses.md maps verl's and TRL's keys to them.
    ("clip_ratio_low", _BOTH, {"type": non_negative_float, "help": "epsilon_low < 1: the ratio is clipped below at "
                                                                  "1 - epsilon_low (default 0.2; cispo: <= 1)"}),
    ("clip_ratio_high", _BOTH, {"type": non_negative_float, "help": "epsilon_high: the ratio is clipped above at "
                                                                   "1 + epsilon_high (default 0.2; DAPO 0.28)"}),
    ("aggregation", _BOTH, {"choices": LOSS_AGGREGATIONS, "help": "how per-token losses become one (default "
                                                                  "token-mean)"}),
    ("dual_clip_ratio", _BOTH, {"type": positive_float, "help": "dual clip c > 1 (default: none; verl's clip_ratio_c "
                                                                "is 3)"}),
    ("log_ratio_clamp", _BOTH, {"type": positive_float,
                                "help": "clamp log(ratio) to [-c, c] (default: none; verl 20)"}),
    ("loss_scale_factor", _BOTH, {"type": positive_float,
                                  "help": "the divisor of seq-mean-token-sum-norm (verl: the response length; TRL "
                                          "dr_grpo: max_completion_length)"}),
    ("entropy_coef", _BOTH, {"type": non_negative_float, "help": "coefficient of the entropy bonus (default 0)"}),
    ("entropy_aggregation", _BOTH, {"choices": LOSS_AGGREGATIONS, "help": "the entropy bonus's aggregation (default: "
                                                                          "--aggregation; TRL: token-mean)"}),
    ("kl_coef", _GRPO, {"type": non_negative_float, "help": "beta of the KL penalty (default 0; > 0 needs ref "
                                                            "log-probs)"}),
    ("kl_estimator", _GRPO, {"choices": LOSS_KL_ESTIMATORS, "help": "the KL penalty's estimator (default k3; verl "
                                                                    "low_var_kl)"}),
    ("kl_importance_weighted", _GRPO, {"action": argparse.BooleanOptionalAction,
                                       "help": "multiply the KL estimate by the ratio (TRL's use_bias_correction_kl)"}),
    ("surrogate", _GRPO, {"choices": LOSS_SURROGATES, "help": "the policy term (default clip)"}),
    ("ratio_cap", _GRPO, {"type": positive_float, "help": "cap of the unclipped ratio (TRL's delta; default none)"}),
    ("importance_sampling_level", _GRPO, {"choices": LOSS_IMPORTANCE_SAMPLING_LEVELS,
                                          "help": "token (default) or sequence (GSPO)"}),
    ("sapo_tau_pos", _GRPO, {"type": positive_float, "help": "SAPO's temperature where A > 0 (default 1.0)"}),
    ("sapo_tau_neg", _GRPO, {"type": positive_float, "help": "SAPO's temperature where A <= 0 (default 1.05)"}),
    ("vespo_k_pos", _GRPO, {"type": non_negative_float, "help": "VESPO's k where A >= 0 (default 2)"}),
    ("vespo_lambda_pos", _GRPO, {"type": positive_float, "help": "VESPO's lambda where A >= 0 (default 3)"}),
    ("vespo_k_neg", _GRPO, {"type": non_negative_float, "help": "VESPO's k where A < 0 (default 3)"}),
    ("vespo_lambda_neg", _GRPO, {"type": positive_float, "help": "VESPO's lambda where A < 0 (default 2)"}),
)

LOSS_SECTION_OPTIONS = (
    # (LossConfig field besides name, grpo and ppo: the same StepConfig field, whichever the loss; argparse keywords):
    # the flag is --FIELD-WITH-DASHES, the YAML key loss.FIELD. Every such field is here (tested).
    ("pooled_balance_coeff", {"type": non_negative_float,
                              "help": "coefficient of transformers' pooled load-balancing loss of each microbatch, "
                                      "added / the step's microbatches (TRL's router_aux_loss_coef; default 0: none; "
                                      "> 0 needs softmax routing whose MoE layers report their statistics)"}),
)


def loss_flag(field: str) -> str:
    """The flag of a LOSS_OPTIONS or LOSS_SECTION_OPTIONS field."""
    return "--" + field.replace("_", "-")


def non_finite_fields(value, prefix: str = "") -> list[str]:
    """`field = value` for every number in nested dicts/lists of `value` that is NaN or infinite."""
    if isinstance(value, dict):
        return [f for key, inner in value.items() for f in non_finite_fields(inner, f"{prefix}{key}.")]
    if isinstance(value, (list, tuple)):
        return [f for i, inner in enumerate(value) for f in non_finite_fields(inner, f"{prefix}{i}.")]
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{prefix.rstrip('.')} = {value}"]
    return []
