"""Per-token RL data moved onto the semantic positions that predict each token (DESIGN §5).

A step stores its per-token fields (loss mask, advantages, old/ref log-probs) for token i *as a
target*; the logits that predict token i sit at position i − 1 of the same trajectory. So the
semantic position s = (x, i − 1) carries target y_s = tokens[x, i] and token i's mask,
advantage and log-probs. The last position of each trajectory predicts nothing: target 0 (any
valid id), mask 0, advantage and log-probs 0.

`semantic_targets(offsets, tokens, loss_mask, advantages, ...)` does this shift on flat arrays in
original batch order (trajectory k owns positions offsets[k]:offsets[k + 1]);
`semantic_targets_from_step(step)` reads the arrays of a `Step`. Outputs are numpy arrays of
length S in the same order, so they line up with the compact map m (int64 [S]) of the step or
of a microbatch built from the same trajectories in the same order.

Invariant (tested): position p has a target iff p + 1 is in the same trajectory and
loss_mask[p + 1] = 1; then targets[p] = tokens[p + 1] and every other field is that of p + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.trees.step import Step


@dataclass(frozen=True, eq=False)
class SemanticTargets:
    """Shifted per-position data of S semantic positions, original batch order."""

    targets: np.ndarray
    """int64 [S] y_s: the next token (0 at the last position of a trajectory)."""
    loss_mask: np.ndarray
    """bool [S] whether position s carries a loss (its next token is masked in)."""
    advantages: np.ndarray
    """float32 [S] advantage of the predicted token."""
    old_logprobs: np.ndarray | None
    """float32 [S] behaviour-policy log-prob of the predicted token, or None (on-policy)."""
    ref_logprobs: np.ndarray | None
    """float32 [S] reference-policy log-prob of the predicted token, or None (no KL term)."""
    trajectory_index: np.ndarray
    """int64 [S] the trajectory (0..N-1) of each position, for per-sequence aggregation."""


def _shift(values: np.ndarray, last_positions: np.ndarray, fill: float | int) -> np.ndarray:
    shifted = np.empty_like(values)
    shifted[:-1] = values[1:]
    shifted[last_positions] = fill
    return shifted


def semantic_targets(
    offsets: np.ndarray,
    tokens: np.ndarray,
    loss_mask: np.ndarray,
    advantages: np.ndarray,
    *,
    old_logprobs: np.ndarray | None = None,
    ref_logprobs: np.ndarray | None = None,
) -> SemanticTargets:
    """Shift target-indexed per-token arrays (length S) onto the predicting positions.

    Args:
        offsets: int [N + 1], 0 = offsets[0] < offsets[1] < ... (every trajectory non-empty).
        tokens: int [S]; loss_mask: [S] 0/1 with loss_mask[offsets[k]] = 0 for every k;
        advantages, old_logprobs, ref_logprobs: float [S], indexed by target token.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or (np.diff(offsets) <= 0).any():
        raise ValueError("semantic_targets: offsets must start at 0 and strictly increase")
    size = int(offsets[-1])
    arrays = {"tokens": tokens, "loss_mask": loss_mask, "advantages": advantages,
              "old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs}
    for name, array in arrays.items():
        if array is not None and np.shape(array) != (size,):
            raise ValueError(f"semantic_targets: {name} has shape {np.shape(array)}, expected ({size},)")
    mask = np.asarray(loss_mask).astype(bool)
    if size and mask[offsets[:-1]].any():
        first = int(offsets[:-1][mask[offsets[:-1]]][0])
        raise ValueError(f"semantic_targets: loss_mask[{first}] is 1 at a trajectory's first token")
    last_positions = offsets[1:] - 1

    def floats(array: np.ndarray | None) -> np.ndarray | None:
        return None if array is None else _shift(np.asarray(array, dtype=np.float32), last_positions, 0.0)

    return SemanticTargets(
        targets=_shift(np.asarray(tokens, dtype=np.int64), last_positions, 0),
        loss_mask=_shift(mask, last_positions, False),
        advantages=floats(advantages),
        old_logprobs=floats(old_logprobs),
        ref_logprobs=floats(ref_logprobs),
        trajectory_index=np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(offsets)),
    )


def semantic_targets_from_step(step: Step) -> SemanticTargets:
    """`semantic_targets` of a step's arrays (scalar advantages broadcast to their tokens)."""
    return semantic_targets(
        step.offsets,
        step.tokens,
        step.loss_mask,
        step.advantages(),
        old_logprobs=step.old_logprobs,
        ref_logprobs=step.ref_logprobs,
    )
