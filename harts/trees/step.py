"""The step: every trajectory of one training step, stored flat.

Provides `Step`, the in-memory form that every later stage reads. Tokens and per-token RL data
are concatenated in the original batch order; trajectory k owns the semantic positions
`offsets[k]:offsets[k + 1]`. Invariants (checked by `Step.__post_init__`, assumed everywhere
else): ids are unique, every trajectory has at least one token, all per-token arrays have
length S = offsets[-1], tokens are non-negative, and `loss_mask[offsets[k]] == 0` for every k
(nothing predicts a trajectory's first token, DESIGN §5).

Per-token fields refer to token i *as a target*: `loss_mask[i] == 1` means the logits at
position i - 1 are trained to predict token i.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TOKEN_DTYPE = np.int32
LOGPROB_FLOOR = -1e4
"""The lowest old or reference log-probability accepted: far below anything a model's log-softmax gives
(a uniform 2^31-token vocabulary is −21.5); lower values are garbage or another unit, and overflow the
loss's ratios and KL (exp(10^4) is inf)."""
MAX_NAME_LENGTH = 1024
"""The longest trajectory or tree id accepted (characters)."""


def check_name(value: str, where: str, field: str) -> None:
    """ValueError unless `value` is a usable id: at most MAX_NAME_LENGTH characters, no control characters (a NUL
    would be stripped by numpy's string arrays, merging two ids)."""
    if len(value) > MAX_NAME_LENGTH:
        raise ValueError(f"{where}: field '{field}': {len(value):,} characters (at most {MAX_NAME_LENGTH})")
    bad = next((c for c in value if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise ValueError(f"{where}: field '{field}': control character {bad!r} in {value[:60]!r}")


@dataclass(frozen=True, eq=False)
class Step:
    """One training step's trajectories (N of them, S semantic tokens in total)."""

    ids: tuple[str, ...]
    """Trajectory ids, unique, length N."""
    trees: tuple[str, ...]
    """Rollout-tree id of each trajectory (the task it was sampled for), length N."""
    offsets: np.ndarray
    """int64 [N + 1]: trajectory k's tokens are tokens[offsets[k]:offsets[k + 1]]."""
    tokens: np.ndarray
    """int32 [S], original batch order."""
    loss_mask: np.ndarray
    """uint8 [S], 1 = token is trained as a target."""
    rewards: np.ndarray
    """float32 [N]."""
    advantage_per_trajectory: np.ndarray | None = None
    """float32 [N] when every trajectory has a scalar advantage; else None."""
    advantage_per_token: np.ndarray | None = None
    """float32 [S] when some trajectory has per-token advantages; else None."""
    old_logprobs: np.ndarray | None = None
    """float32 [S] or None (on-policy: the old log-probs are the current ones, detached)."""
    ref_logprobs: np.ndarray | None = None
    """float32 [S] or None (no KL penalty term)."""
    source: str = "<memory>"
    """Where the step was read from, for error messages."""
    _lengths: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        num = len(self.ids)
        assert len(self.trees) == num
        assert self.offsets.shape == (num + 1,) and self.offsets[0] == 0
        lengths = np.diff(self.offsets)
        assert (lengths > 0).all(), "every trajectory has at least one token"
        size = int(self.offsets[-1])
        assert self.tokens.shape == (size,) and self.tokens.dtype == TOKEN_DTYPE
        assert self.loss_mask.shape == (size,) and self.loss_mask.dtype == np.uint8
        assert self.rewards.shape == (num,)
        assert (self.advantage_per_trajectory is None) != (self.advantage_per_token is None)
        for name in ("advantage_per_token", "old_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            assert value is None or value.shape == (size,), name
        if self.advantage_per_trajectory is not None:
            assert self.advantage_per_trajectory.shape == (num,)
        object.__setattr__(self, "_lengths", lengths)

    @property
    def num_trajectories(self) -> int:
        return len(self.ids)

    @property
    def num_semantic_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def lengths(self) -> np.ndarray:
        """int64 [N]: tokens per trajectory."""
        return self._lengths

    def trajectory_tokens(self, k: int) -> np.ndarray:
        return self.tokens[self.offsets[k] : self.offsets[k + 1]]

    def advantages(self) -> np.ndarray:
        """float32 [S]: the advantage of every token as a target (scalars broadcast)."""
        if self.advantage_per_token is not None:
            return self.advantage_per_token
        return np.repeat(self.advantage_per_trajectory, self.lengths)

    def subset(self, indices: np.ndarray) -> Step:
        """The step restricted to trajectories `indices` (in that order)."""
        indices = np.asarray(indices, dtype=np.int64)
        lengths = self.lengths[indices]
        offsets = np.zeros(len(indices) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        gather = np.concatenate(
            [np.arange(self.offsets[k], self.offsets[k + 1]) for k in indices]
        ) if len(indices) else np.zeros(0, dtype=np.int64)

        def per_token(array: np.ndarray | None) -> np.ndarray | None:
            return None if array is None else array[gather]

        return Step(
            ids=tuple(self.ids[k] for k in indices),
            trees=tuple(self.trees[k] for k in indices),
            offsets=offsets,
            tokens=self.tokens[gather],
            loss_mask=self.loss_mask[gather],
            rewards=self.rewards[indices],
            advantage_per_trajectory=(
                None if self.advantage_per_trajectory is None
                else self.advantage_per_trajectory[indices]
            ),
            advantage_per_token=per_token(self.advantage_per_token),
            old_logprobs=per_token(self.old_logprobs),
            ref_logprobs=per_token(self.ref_logprobs),
            source=self.source,
        )


def grpo_advantages(rewards: np.ndarray, groups: tuple[str, ...] | list[str], eps: float = 1e-6) -> np.ndarray:
    """GRPO advantages: each reward normalised by its group's mean and std (0 where all are equal)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    keys, inverse = np.unique(np.asarray(groups), return_inverse=True)
    counts = np.bincount(inverse, minlength=len(keys))
    mean = np.bincount(inverse, weights=rewards, minlength=len(keys)) / counts
    var = np.bincount(inverse, weights=(rewards - mean[inverse]) ** 2, minlength=len(keys)) / counts
    std = np.sqrt(var)[inverse]
    centred = rewards - mean[inverse]
    return np.where(std > 0, centred / (std + eps), 0.0).astype(np.float32)
