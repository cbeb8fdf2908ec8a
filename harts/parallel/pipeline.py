"""Pipeline schedule: 1F1B over torch.distributed point-to-point, one microbatch order on every stage.

`one_f_one_b(num_microbatches, stage, num_stages)` is the order of forward ("F", j) and
backward ("B", j) steps of a stage (PipeDream-flush / megatron's non-interleaved 1F1B): stage s
runs min(S − s − 1, M) warm-up forwards, then alternates one forward and one backward, then
drains the remaining backwards. At most S − s microbatches are in flight on stage s. With one
stage it is F0 B0 F1 B1 ... (the single-process order).

`PipelineLink` moves activations between adjacent stages: a forward sends the stage's output
rows to the next stage (non-blocking `isend`, buffers kept until the step ends), a stage
receives its input with a blocking `recv`; backwards send the input's gradient back the same
way. No shape is sent: every stage builds the same layout for a microbatch from the plan (it is
deterministic), so the receiver knows the rows (R, or the SP shard P) and the hidden size, and
the residual stream's dtype is the parameters' dtype. With sends never blocking and every stage
receiving in schedule order, 1F1B cannot deadlock (tests/parallel/test_pipeline.py simulates
the message order for many stage and microbatch counts).

Why not torch.distributed.pipelining: its stages exchange tensors of shapes fixed at the first
microbatch (or inferred by an extra round trip), and its stage modules take tensors only; here
every microbatch has its own row count and a `Layout` (KDA schedule, attention groups,
multiplicities) that every layer needs, and each stage adds its MoE losses to the backward of
its own microbatch. A ~60-line schedule over isend/recv is simpler than adapting both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def one_f_one_b(num_microbatches: int, stage: int, num_stages: int) -> list[tuple[str, int]]:
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [("F", j) for j in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", j) for j in range(num_microbatches - warmup, num_microbatches)]
    return order


class PipelineLink:
    """Point-to-point transfers of one stage with its neighbours (global ranks, default group)."""

    def __init__(self, previous_rank: int | None, next_rank: int | None) -> None:
        self.previous_rank, self.next_rank = previous_rank, next_rank
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _send(self, tensor: torch.Tensor, rank: int) -> None:
        tensor = tensor.detach().contiguous()
        self._pending.append((dist.isend(tensor, dst=rank), tensor))

    def _receive(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, rank: int) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=rank)
        return tensor

    def send_forward(self, x: torch.Tensor) -> None:
        self._send(x, self.next_rank)

    def receive_forward(self, shape, dtype, device) -> torch.Tensor:
        return self._receive(shape, dtype, device, self.previous_rank)

    def send_backward(self, grad: torch.Tensor) -> None:
        self._send(grad, self.previous_rank)

    def receive_backward(self, shape, dtype, device) -> torch.Tensor:
        return self._receive(shape, dtype, device, self.next_rank)

    def wait(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
