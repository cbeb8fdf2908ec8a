"""Batch conversion of `harts.api`: an RL trainer's batch in its own layout (padded, packed, a list of
trajectories: the layouts of the package docstring) as a HARTS step that remembers the way back (`RLBatch`).

`padded_batch`, `packed_batch` and `trajectory_batch` check every field (names, shapes, one response width, 0/1
masks, finite values and log-probabilities in [-1e4, 0] where the loss mask is 1) and refuse a bad one in one line
naming it; `as_batch` takes any of the three. Tested in tests/test_api.py (each layout against each sequence alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from harts.trees.step import LOGPROB_FLOOR, TOKEN_DTYPE, Step

PER_TOKEN_FIELDS = ("loss_mask", "advantages", "old_log_probs", "ref_log_probs")
ALIASES = {"response_mask": "loss_mask", "ref_log_prob": "ref_log_probs"}
"""Other frameworks' names of the same fields (verl's)."""
PADDING_SIDES = ("left", "right")


@dataclass(frozen=True, eq=False)
class RLBatch:
    """A batch as a HARTS step, with the way back to the batch's own layout."""

    step: Step
    """The sequences as trajectories, in batch order (trajectory k = sequence k)."""
    kind: str
    """"padded", "packed" or "trajectories"."""
    shape: tuple[int, ...]
    """(B, L) padded, (T,) packed, (B,) for a list."""
    flat_index: np.ndarray
    """int64 [S]: where each of the step's tokens sits in the batch, flattened (padded: b·L + t)."""
    has_loss_mask: bool
    has_advantages: bool
    locate: Callable[[int], str]
    """The batch coordinates of step token k, for error messages ("row 3, column 17")."""

    @property
    def num_sequences(self) -> int:
        return self.step.num_trajectories

    def prediction_mask(self, among: np.ndarray | None = None) -> torch.Tensor | list[torch.Tensor]:
        """bool, the batch's layout: True where a token is predicted (real, not a sequence's first), and, with
        `among` (bool [S], step order), where `among` is True."""
        has_prediction = np.ones(self.step.num_semantic_tokens, dtype=bool)
        has_prediction[self.step.offsets[:-1]] = False
        if among is not None:
            has_prediction &= among
        return self.to_layout(torch.from_numpy(has_prediction))

    def to_layout(self, values_S: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """Values of the step's tokens [S] (step order) placed in the batch's layout, zero at
        padding (differentiable)."""
        if self.kind == "padded":
            flat_index = torch.from_numpy(self.flat_index).to(values_S.device)
            zeros = values_S.new_zeros(math.prod(self.shape))
            return zeros.index_copy(0, flat_index, values_S).view(self.shape)
        if self.kind == "packed":
            return values_S
        return list(values_S.split(self.step.lengths.tolist()))

    def targets_from_predictions(self, values_S: torch.Tensor) -> torch.Tensor:
        """Values of the semantic positions [S] (position i of a trajectory predicts token i + 1)
        moved to the tokens they predict: out[k] = values[k − 1], 0 at each trajectory's first token."""
        shifted = torch.cat([values_S.new_zeros(1), values_S[:-1]])
        first = torch.from_numpy(self.step.offsets[:-1]).to(values_S.device)
        return shifted.index_fill(0, first, 0)


# ---------------------------------------------------------------------------------------------
# Batch conversion


def _numpy(value: Any, where: str, name: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        if tensor.dtype in (torch.bfloat16, torch.float16):
            tensor = tensor.float()
        return tensor.numpy()
    array = np.asarray(value)
    if array.dtype == object:
        raise ValueError(f"{where}: field '{name}': expected a tensor or array of numbers")
    return array


def _fields(batch: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> dict[str, Any]:
    """The batch's fields under their canonical names (aliases resolved); unknown names refused, so
    a misspelled optional field (which would silently change the loss) cannot pass."""
    if not hasattr(batch, "keys"):
        raise ValueError(f"{where}: expected a mapping of field names to tensors, got {type(batch).__name__}")
    fields: dict[str, Any] = {}
    for key in batch.keys():
        name = ALIASES.get(key, key)
        if name not in allowed:
            known = ", ".join(sorted(set(allowed) | {a for a, n in ALIASES.items() if n in allowed}))
            raise ValueError(f"{where}: unknown field {key!r} (accepted: {known})")
        if batch[key] is None:
            continue
        if name in fields:
            raise ValueError(f"{where}: field {key!r} given twice (under two of its names)")
        fields[name] = batch[key]
    if "input_ids" not in fields:
        raise ValueError(f"{where}: field 'input_ids' is required")
    return fields


def _integers(array: np.ndarray, where: str, name: str) -> np.ndarray:
    if array.dtype == bool or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{where}: field '{name}': expected integers, got {array.dtype}")
    return array.astype(np.int64)


def _zero_one(array: np.ndarray, where: str, name: str) -> np.ndarray:
    if array.dtype != bool:
        if not (np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)):
            raise ValueError(f"{where}: field '{name}': expected 0/1 values, got {array.dtype}")
        bad = np.argwhere((array != 0) & (array != 1))
        if len(bad):
            index = tuple(int(i) for i in bad[0])
            raise ValueError(f"{where}: field '{name}': expected 0/1 values, got {array[index].item()!r} at index "
                             f"{list(index)}")
    return array.astype(bool)


def _build(
    kind: str, shape: tuple[int, ...], flat_index: np.ndarray, offsets: np.ndarray, tokens: np.ndarray,
    per_token: dict[str, np.ndarray], per_sequence_advantages: np.ndarray | None, where: str,
    locate: Callable[[int], str],
) -> RLBatch:
    """The step of flat per-token arrays [S] (values at the real tokens, batch order), checked."""
    size, num = int(offsets[-1]), len(offsets) - 1
    bad = np.flatnonzero((tokens < 0) | (tokens > np.iinfo(TOKEN_DTYPE).max))
    if len(bad):
        raise ValueError(f"{where}: field 'input_ids': token {int(tokens[bad[0]])} at {locate(int(bad[0]))} "
                         "is not a token id (>= 0)")
    loss_mask = per_token.get("loss_mask", np.zeros(size, dtype=bool))
    first_masked = np.flatnonzero(loss_mask[offsets[:-1]])
    if len(first_masked):
        k = int(offsets[first_masked[0]])
        raise ValueError(f"{where}: field 'loss_mask': 1 at {locate(k)}, the first token of its sequence "
                         "(nothing predicts it)")
    values = {}
    for name in ("advantages", "old_log_probs", "ref_log_probs"):
        if name not in per_token:
            continue
        array = per_token[name].astype(np.float64)
        bad = np.flatnonzero(loss_mask & ~np.isfinite(array))
        if len(bad):
            raise ValueError(f"{where}: field '{name}': {array[bad[0]]} at {locate(int(bad[0]))}, where the loss "
                             "mask is 1 (must be finite)")
        if name != "advantages":
            bad = np.flatnonzero(loss_mask & ((array > 0) | (array < LOGPROB_FLOOR)))
            if len(bad):
                raise ValueError(f"{where}: field '{name}': {array[bad[0]]} at {locate(int(bad[0]))}, where the loss "
                                 f"mask is 1 (log-probabilities must be in [{LOGPROB_FLOOR:g}, 0])")
        # Values the loss mask excludes are never read: padding may hold anything.
        values[name] = np.where(loss_mask, array, 0.0).astype(np.float32)
    if per_sequence_advantages is not None:
        array = per_sequence_advantages.astype(np.float64)
        bad = np.flatnonzero(~np.isfinite(array))
        if len(bad):
            raise ValueError(
                f"{where}: field 'advantages': {array[bad[0]]} for sequence {int(bad[0])} (must be finite)"
            )
    has_advantages = per_sequence_advantages is not None or "advantages" in values
    if not has_advantages:
        per_sequence_advantages = np.zeros(num)
    step = Step(
        ids=tuple(str(b) for b in range(num)),
        trees=tuple(str(b) for b in range(num)),
        offsets=offsets,
        tokens=tokens.astype(TOKEN_DTYPE),
        loss_mask=loss_mask.astype(np.uint8),
        rewards=np.zeros(num, dtype=np.float32),
        advantage_per_trajectory=(
            None if per_sequence_advantages is None else per_sequence_advantages.astype(np.float32)
        ),
        advantage_per_token=values.get("advantages") if per_sequence_advantages is None else None,
        old_logprobs=values.get("old_log_probs"),
        ref_logprobs=values.get("ref_log_probs"),
        source=where,
    )
    return RLBatch(
        step=step, kind=kind, shape=shape, flat_index=flat_index, has_loss_mask="loss_mask" in per_token,
        has_advantages=has_advantages, locate=locate,
    )


def padded_batch(batch: Mapping[str, Any], *, padding_side: str | None = None) -> RLBatch:
    """A padded batch ([B, L] `input_ids` and `attention_mask`, module docstring) as a HARTS step.

    Args:
        batch: a mapping (dict, TensorDict, ...) of `input_ids`, `attention_mask` and optional
            `loss_mask`/`response_mask`, `advantages`, `old_log_probs`, `ref_log_probs`/`ref_log_prob`
            (tensors or arrays, any device); other names are refused.
        padding_side: "left" (real tokens end at column L − 1), "right" (they start at column 0), or
            None: any one contiguous run per row (left, right, or verl's prompt-left/response-right).
    """
    where = "padded batch"
    if padding_side is not None and padding_side not in PADDING_SIDES:
        raise ValueError(f"{where}: padding_side must be one of {PADDING_SIDES} or None, got {padding_side!r}")
    fields = _fields(batch, ("input_ids", "attention_mask", *PER_TOKEN_FIELDS), where)
    input_ids = _integers(_numpy(fields["input_ids"], where, "input_ids"), where, "input_ids")
    if input_ids.ndim != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"{where}: field 'input_ids': expected a non-empty [B, L] array, got shape {input_ids.shape}")
    num, length = input_ids.shape
    if "attention_mask" not in fields:
        raise ValueError(f"{where}: field 'attention_mask' is required (it says where the padding is)")
    attention = _zero_one(_numpy(fields["attention_mask"], where, "attention_mask"), where, "attention_mask")
    if attention.shape != input_ids.shape:
        raise ValueError(f"{where}: field 'attention_mask': shape {attention.shape} != input_ids' {input_ids.shape}")
    counts = attention.sum(axis=1)
    first = attention.argmax(axis=1)
    last = length - 1 - attention[:, ::-1].argmax(axis=1)
    for b in np.flatnonzero(counts == 0):
        raise ValueError(f"{where}: field 'attention_mask': row {int(b)} has no real token")
    for b in np.flatnonzero(last - first + 1 != counts):
        hole = int(first[b] + np.argmin(attention[b, first[b]:]))
        raise ValueError(f"{where}: field 'attention_mask': row {int(b)} is not one contiguous run of real "
                         f"tokens (0 at column {hole} between 1s)")
    if padding_side == "left":
        for b in np.flatnonzero(last != length - 1):
            raise ValueError(f"{where}: padding_side 'left' but row {int(b)} has padding after its last real token "
                             f"(column {int(last[b])})")
    if padding_side == "right":
        for b in np.flatnonzero(first != 0):
            raise ValueError(f"{where}: padding_side 'right' but row {int(b)} starts with padding (first real token "
                             f"at column {int(first[b])})")

    response: list[tuple[str, int]] = []
    """(field, R) of the first field given response-shaped: every other one must have the same R."""

    def full_width(name: str, array: np.ndarray) -> np.ndarray:
        """[B, L] of a [B, L] or [B, R] (last R columns) field; columns before R are 0."""
        if array.ndim != 2 or array.shape[0] != num or not 0 < array.shape[1] <= length:
            raise ValueError(f"{where}: field '{name}': expected shape [{num}, L] or [{num}, R] with R <= L = "
                             f"{length}, got {array.shape}")
        if array.shape[1] == length:
            return array
        if response and response[0][1] != array.shape[1]:
            first, width = response[0]
            raise ValueError(f"{where}: field '{name}': [{num}, {array.shape[1]}] but field '{first}' is [{num}, "
                             f"{width}] (response-shaped fields are the last R columns: one R for all)")
        response.append((name, array.shape[1]))
        full = np.zeros((num, length), dtype=array.dtype)
        full[:, length - array.shape[1]:] = array
        return full

    real = attention.reshape(-1)
    per_token: dict[str, np.ndarray] = {}
    per_sequence_advantages = None
    if "loss_mask" in fields:
        mask = full_width("loss_mask", _zero_one(_numpy(fields["loss_mask"], where, "loss_mask"), where, "loss_mask"))
        outside = np.flatnonzero(mask.reshape(-1) & ~real)
        if len(outside):
            b, t = divmod(int(outside[0]), length)
            raise ValueError(f"{where}: field 'loss_mask': 1 at row {b}, column {t}, which is padding "
                             "(attention_mask 0)")
        per_token["loss_mask"] = mask.reshape(-1)[real]
    for name in ("advantages", "old_log_probs", "ref_log_probs"):
        if name not in fields:
            continue
        array = _numpy(fields[name], where, name)
        if not np.issubdtype(array.dtype, np.number) or array.dtype == bool:
            raise ValueError(f"{where}: field '{name}': expected numbers, got {array.dtype}")
        if name == "advantages" and (array.ndim == 1 or array.shape == (num, 1)):
            if array.shape not in ((num,), (num, 1)):
                raise ValueError(f"{where}: field 'advantages': expected [{num}] or [{num}, 1] (one per sequence) or "
                                 f"a per-token array, got {array.shape}")
            per_sequence_advantages = array.reshape(num)
            continue
        per_token[name] = full_width(name, array).reshape(-1)[real]
    offsets = np.zeros(num + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    flat_index = np.flatnonzero(real)

    def locate(k: int) -> str:
        b, t = divmod(int(flat_index[k]), length)
        return f"row {b}, column {t}"

    return _build(
        "padded", (num, length), flat_index, offsets, input_ids.reshape(-1)[real], per_token,
        per_sequence_advantages, where, locate,
    )


def packed_batch(batch: Mapping[str, Any]) -> RLBatch:
    """A packed batch (`input_ids` [T], `cu_seqlens` [B + 1], per-token fields [T]) as a HARTS step."""
    where = "packed batch"
    fields = _fields(batch, ("input_ids", "cu_seqlens", *PER_TOKEN_FIELDS), where)
    input_ids = _integers(_numpy(fields["input_ids"], where, "input_ids"), where, "input_ids")
    if input_ids.ndim != 1 or not len(input_ids):
        raise ValueError(f"{where}: field 'input_ids': expected a non-empty [T] array, got shape {input_ids.shape}")
    if "cu_seqlens" not in fields:
        raise ValueError(
            f"{where}: field 'cu_seqlens' is required (sequence b is input_ids[cu_seqlens[b]:cu_seqlens[b + 1]])"
        )
    offsets = _integers(_numpy(fields["cu_seqlens"], where, "cu_seqlens"), where, "cu_seqlens")
    total = len(input_ids)
    if offsets.ndim != 1 or len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(f"{where}: field 'cu_seqlens': expected [B + 1] offsets from 0 to T = {total}, got "
                         f"{offsets.tolist() if offsets.size <= 8 else offsets.shape}")
    empty = np.flatnonzero(np.diff(offsets) <= 0)
    if len(empty):
        raise ValueError(f"{where}: field 'cu_seqlens': sequence {int(empty[0])} is empty or reversed "
                         f"({int(offsets[empty[0]])} to {int(offsets[empty[0] + 1])})")
    return _flat("packed", (total,), input_ids, offsets, fields, where)


def trajectory_batch(trajectories: Sequence[Mapping[str, Any]]) -> RLBatch:
    """A list of trajectories (mappings of `input_ids` [n] and per-token fields [n]; `advantages`
    may be a number) as a HARTS step."""
    where = "trajectory batch"
    if isinstance(trajectories, Mapping) or not isinstance(trajectories, Sequence) or not len(trajectories):
        raise ValueError(f"{where}: expected a non-empty list of trajectories (mappings)")
    pieces: dict[str, list[np.ndarray]] = {}
    lengths, names = [], None
    for i, trajectory in enumerate(trajectories):
        here = f"{where}: trajectory {i}"
        fields = _fields(trajectory, ("input_ids", *PER_TOKEN_FIELDS), here)
        if names is None:
            names = set(fields)
        elif set(fields) != names:
            raise ValueError(f"{here}: has fields {sorted(fields)} but trajectory 0 has {sorted(names)} "
                             "(give an optional field for every trajectory or for none)")
        tokens = _integers(_numpy(fields["input_ids"], here, "input_ids"), here, "input_ids")
        if tokens.ndim != 1 or not len(tokens):
            raise ValueError(f"{here}: field 'input_ids': expected a non-empty [n] array, got shape {tokens.shape}")
        lengths.append(len(tokens))
        for name, value in fields.items():
            array = _numpy(value, here, name)
            if name == "advantages" and array.ndim == 0:
                array = np.full(len(tokens), array.item(), dtype=np.float64)
            if array.shape != tokens.shape:
                raise ValueError(
                    f"{here}: field '{name}': shape {array.shape} does not match input_ids' {tokens.shape}"
                )
            pieces.setdefault(name, []).append(array)
    flat = {name: np.concatenate(arrays) for name, arrays in pieces.items()}
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    input_ids = _integers(flat.pop("input_ids"), where, "input_ids")
    return _flat("trajectories", (len(lengths),), input_ids, offsets, flat, where)


def _flat(kind: str, shape: tuple[int, ...], input_ids: np.ndarray, offsets: np.ndarray, fields: dict[str, Any],
          where: str) -> RLBatch:
    """Packed and listed batches: per-token fields [T] (advantages [T] or [B])."""
    total, num = len(input_ids), len(offsets) - 1
    per_token: dict[str, np.ndarray] = {}
    per_sequence_advantages = None
    for name in PER_TOKEN_FIELDS:
        if name not in fields:
            continue
        array = _numpy(fields[name], where, name)
        if name == "loss_mask":
            array = _zero_one(array, where, name)
        elif not np.issubdtype(array.dtype, np.number) or array.dtype == bool:
            raise ValueError(f"{where}: field '{name}': expected numbers, got {array.dtype}")
        if name == "advantages" and (array.shape == (num, 1) or array.shape == (num,) and num != total):
            per_sequence_advantages = array.reshape(num)
            continue
        if array.shape != (total,):
            raise ValueError(f"{where}: field '{name}': expected shape ({total},), got {array.shape}")
        per_token[name] = array

    def locate(k: int) -> str:
        b = int(np.searchsorted(offsets, k, side="right") - 1)
        return f"sequence {b}, token {k - int(offsets[b])}"

    return _build(kind, shape, np.arange(total, dtype=np.int64), offsets, input_ids, per_token,
                   per_sequence_advantages, where, locate)


def as_batch(batch: RLBatch | Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> RLBatch:
    """`batch` as an RLBatch: as given; a mapping with `cu_seqlens` → `packed_batch`; another mapping
    → `padded_batch` (padding side read off the mask); a list of mappings → `trajectory_batch`."""
    if isinstance(batch, RLBatch):
        return batch
    if hasattr(batch, "keys"):
        return packed_batch(batch) if "cu_seqlens" in batch.keys() else padded_batch(batch)
    return trajectory_batch(batch)
