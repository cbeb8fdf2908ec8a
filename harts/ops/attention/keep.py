"""Attention outputs kept from an activation checkpoint's forward for its recomputation, without a dispatch mode.

`keeper_contexts()` is a `context_fn` for `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: it makes
one `AttentionKeeper` per checkpointed call and returns its two contexts, entered around the forward and around
each recomputation. While one is entered, `active_keeper()` returns the keeper, and an attention that supports it
(`triton_tree` and `flash4_tree` through `keepable_attention`; `flash4` through `kept_attention`, since its plain
path is a dispatcher op for torch's selective policy) records its output and log-sum-exp in the forward
(`AttentionKeeper.record`) and, in the recomputation, takes them back in the same order (`replay`) instead of
running its kernel again. Its autograd node saves only its inputs through the checkpoint,
which recomputes those, and reads the kept values from the keeper, which lives exactly as long as the checkpoint's
saved tensors (it is freed with them after the backward, or kept with them by `retain_graph`).

Why not torch's selective checkpointing (`create_selective_checkpoint_contexts`, which the other backends use):
its contexts are dispatch modes, so every op of the checkpointed block, not only the attention, goes through
Python in the forward and again in the recomputation (about 10 µs an op here; 373 ops in the tiny model's MLA
block). Here the only cost is a thread-local read per attention call.

Invariant (tests/ops/attention/test_flash4.py): a recomputation that keeps the attention calls its forward kernel
once instead of twice and gives the same gradients bit for bit, also when the backward runs twice
(`retain_graph`), since a recomputation replays from the start.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable, NamedTuple

import torch

_ACTIVE = threading.local()


def _stack() -> list[tuple[AttentionKeeper, bool]]:
    if not hasattr(_ACTIVE, "stack"):
        _ACTIVE.stack = []
    return _ACTIVE.stack


class _Context:
    """Entered around the forward (`replaying` False) or each recomputation (True); re-enterable, since a
    checkpoint enters its recomputation context once per backward."""

    def __init__(self, keeper: AttentionKeeper, replaying: bool) -> None:
        self.keeper, self.replaying = keeper, replaying

    def __enter__(self) -> None:
        self.keeper.cursor = 0
        _stack().append((self.keeper, self.replaying))

    def __exit__(self, *exc) -> None:
        # Its own entry, not the top one: under torch 2.11 a block that raised leaves its checkpoint's generator,
        # and this context in it, open until the generator is collected (`keeper_scope` drops the entry then).
        stack = _stack()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] is self.keeper and stack[i][1] == self.replaying:
                del stack[i]
                return


class AttentionKeeper:
    """The kept values of one checkpointed call, in the order of its attention calls."""

    def __init__(self) -> None:
        self.kept: list[Any] = []
        self.cursor = 0

    def record(self, value: Any) -> int:
        """Keep `value`; its index."""
        self.kept.append(value)
        return len(self.kept) - 1

    def replay(self) -> tuple[Any, int]:
        """The next kept value of this recomputation, and its index."""
        assert self.cursor < len(self.kept), "a recomputation made more attention calls than its forward"
        self.cursor += 1
        return self.kept[self.cursor - 1], self.cursor - 1


def active_keeper() -> tuple[AttentionKeeper, bool] | None:
    """(keeper, replaying) of the innermost entered context of this thread, or None."""
    stack = _stack()
    return stack[-1] if stack else None


@contextmanager
def keeper_scope():
    """Around a checkpointed call: if it raises, the keeper entries it left on this thread's stack are dropped
    (under torch 2.11 its forward context would otherwise stay entered until the garbage collector closes the
    checkpoint's generator, and every later attention call would record into that keeper)."""
    stack = _stack()
    depth = len(stack)
    try:
        yield
    except BaseException:
        del stack[depth:]
        raise


def keeper_contexts() -> tuple[_Context, _Context]:
    """A checkpoint `context_fn`: the forward and recomputation contexts of a new keeper."""
    keeper = AttentionKeeper()
    return _Context(keeper, False), _Context(keeper, True)


class AttentionKernels(NamedTuple):
    """An attention's two kernels: `forward(q, k, v) -> (out, lse)` and `backward(dout, q, k, v, out, lse) -> (dq,
    dk, dv)`, closed over everything else they take (lengths, tile lists, scale)."""

    forward: Callable
    backward: Callable


class _Attention(torch.autograd.Function):
    """An attention outside a keeper: the forward kernel's out and lse saved for the backward kernel."""

    @staticmethod
    def forward(ctx, q, k, v, kernels: AttentionKernels):
        out, lse = kernels.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernels = kernels
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*ctx.kernels.backward(dout, q, k, v, out, lse), None)


class _KeptAttention(torch.autograd.Function):
    """An attention inside a checkpoint whose keeper is active: the forward runs the kernel and records (out, lse),
    a recomputation replays them. The node saves q, k and v through the checkpoint (in the same order in both, so
    that its recomputation matches them) and reads out and lse from the keeper, held by a weak reference and an
    index: the node outlives its backward (a caller may hold the loss), the kept values must not."""

    @staticmethod
    def forward(ctx, q, k, v, kernels: AttentionKernels, keeper: AttentionKeeper, replaying: bool):
        if replaying:
            (out, lse), index = keeper.replay()
        else:
            out, lse = kernels.forward(q, k, v)
            index = keeper.record((out.detach(), lse.detach()))
        ctx.keeper, ctx.index, ctx.kernels = weakref.ref(keeper), index, kernels
        ctx.save_for_backward(q, k, v)
        return out.detach()

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors  # alive while the keeper is
        out, lse = ctx.keeper().kept[ctx.index]
        return (*ctx.kernels.backward(dout, q, k, v, out, lse), None, None, None)


def kept_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernels: AttentionKernels,
                   keeper: AttentionKeeper, replaying: bool) -> torch.Tensor:
    """out of `kernels` on q, k and v, differentiable in them, under the active keeper (`active_keeper()`): its
    forward kernel runs in the checkpoint's forward only, and each recomputation replays the output."""
    return _KeptAttention.apply(q, k, v, kernels, keeper, replaying)


def keepable_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernels: AttentionKernels) -> torch.Tensor:
    """out of `kernels` on q, k and v, differentiable in them: `kept_attention` under an active keeper while
    gradients are on, else a plain node that saves out and lse for the backward kernel."""
    active = active_keeper()
    if active is None or not torch.is_grad_enabled():
        return _Attention.apply(q, k, v, kernels)
    return kept_attention(q, k, v, kernels, *active)
